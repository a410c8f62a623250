"""Seeded bugs of GRPO rollout generation, tokenization and rewards, each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

CACHE = "tests/unit/grpo/test_rollout_cache.py"
SAMPLER = "tests/unit/grpo/test_sampler.py"
METRICS = "tests/unit/grpo/test_rollout_metrics.py"
PROMPTS = "tests/unit/grpo/test_math_prompts.py"
TOKENIZER = "tests/unit/data/test_tokenizer.py"
REWARDS = "tests/unit/grpo/test_rewards.py"
OBJECTIVE_SAMPLING = "tests/unit/grpo/test_objective_sampling.py::test_every_sampling_flag_reaches_the_rollout_sampler"

MUTANTS: list[dict] = [
    {
        "name": "rollout-cached-leaves-model-in-eval",
        "why": "the KV-cached sampler switches the chunks to eval and never back: training passes run in eval mode",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "        for chunk, mode in zip(model, was_training):\n            chunk.train(mode)\n",
        "new": "        pass\n",
        "tests": [f"{CACHE}::test_cached_generation_gives_the_model_its_mode_back"],
    },
    {
        "name": "rollout-seed-ignores-step",
        "why": "completion seeds do not depend on the rollout step: every rollout replays the same uniforms",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "key = repr((int(seed), int(step), canonical_id(prompt_id), int(index))).encode()",
        "new": "key = repr((int(seed), 0, canonical_id(prompt_id), int(index))).encode()",
        "tests": [f"{SAMPLER}::test_each_rollout_step_draws_afresh"],
    },
    {
        "name": "rollout-empty-prompt-accepted",
        "why": "an empty prompt reaches the model (index -1 of an empty row) instead of a clear error",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "        if not tokens:\n            raise ValueError",
        "new": "        if False:\n            raise ValueError",
        "tests": [f"{CACHE}::test_an_empty_prompt_is_refused_cached_or_not"],
    },
    {
        "name": "sampling-stop-ids-not-passed",
        "why": "build_objective drops the generation config's stop ids: completions run past end-of-turn",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "max_new_tokens=grpo.max_new_tokens, eos_id=source.eos_id, stop_ids=source.stop_ids, pad_id=source.pad_id,",
        "new": "max_new_tokens=grpo.max_new_tokens, eos_id=source.eos_id, pad_id=source.pad_id,",
        "tests": [OBJECTIVE_SAMPLING],
    },
    {
        "name": "sampling-top-p-not-passed",
        "why": "--top-p never reaches the sampler",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "seed=train_cfg.seed, temperature=grpo.temperature, top_p=grpo.top_p, kv_cache=grpo.kv_cache,",
        "new": "seed=train_cfg.seed, temperature=grpo.temperature, kv_cache=grpo.kv_cache,",
        "tests": [OBJECTIVE_SAMPLING],
    },
    {
        "name": "sampling-kv-cache-not-passed",
        "why": "--kv-cache never reaches the sampler (full recompute every token)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "seed=train_cfg.seed, temperature=grpo.temperature, top_p=grpo.top_p, kv_cache=grpo.kv_cache,",
        "new": "seed=train_cfg.seed, temperature=grpo.temperature, top_p=grpo.top_p,",
        "tests": [OBJECTIVE_SAMPLING],
    },
    {
        "name": "score-keeps-the-stop-token",
        "why": "the reward decodes the completion with its ending stop token: its text follows the answer",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        if completion and completion[-1] in stops:\n            completion = completion[:-1]\n",
        "new": "",
        "tests": [f"{PROMPTS}::test_the_stop_token_that_ends_a_completion_is_not_graded"],
    },
    {
        "name": "accuracy-counts-partial-rewards",
        "why": "the accuracy metric counts every completion with a positive reward as correct",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "\"accuracy\": float((rewards == 1.0).double().mean())",
        "new": "\"accuracy\": float((rewards > 0).double().mean())",
        "tests": [f"{METRICS}::test_accuracy_counts_only_fully_correct_completions"],
    },
    {
        "name": "clipped-metric-ignores-stop-ids",
        "why": "the trainer counts completions ended by a generation-config stop id as clipped",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "                                  ends=self.source.stop_ids | {self.source.eos_id})",
        "new": "                                  ends=frozenset({self.source.eos_id}))",
        "tests": [f"{METRICS}::test_a_completion_ended_by_a_stop_id_is_not_clipped"],
    },
    {
        "name": "hf-vocab-size-without-added-tokens",
        "why": "HFTokenizer.vocab_size uses the base vocabulary, without added tokens: generation_config eos ids "
               "that are added tokens (<|im_end|>, <|eot_id|>) are dropped as out of range",
        "file": "megatron_prune/data/tokenizer.py",
        "old": "        return len(self._tok)\n",
        "new": "        return self._tok.vocab_size\n",
        "tests": [f"{TOKENIZER}::test_a_stop_id_that_is_an_added_token_ends_replies"],
    },
    {
        "name": "hf-encode-adds-special-tokens",
        "why": "HFTokenizer.encode lets the post-processor add BOS: a chat-templated prompt that already "
               "renders BOS gets two",
        "file": "megatron_prune/data/tokenizer.py",
        "old": "        return list(self._tok.encode(text, add_special_tokens=False))\n",
        "new": "        return list(self._tok.encode(text))\n",
        "tests": [f"{TOKENIZER}::test_a_post_processor_that_adds_bos_adds_none_to_encoded_text"],
    },
    {
        "name": "generation-eos-ids-accept-bools",
        "why": "a JSON true in generation_config eos_token_id is taken as id 1",
        "file": "megatron_prune/data/tokenizer.py",
        "old": "if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size}",
        "new": "if isinstance(i, int) and 0 <= i < vocab_size}",
        "tests": [f"{TOKENIZER}::test_a_json_true_among_the_generation_eos_ids_is_no_token"],
    },
    {
        "name": "gsm8k-hyphen-after-letter-is-a-sign",
        "why": "a hyphen after a letter is read as a minus sign (B-12 -> -12)",
        "file": "megatron_prune/grpo/rewards.py",
        "old": "cleaned[last.start() - 1].isalnum():",
        "new": "cleaned[last.start() - 1].isdigit():",
        "tests": [f"{REWARDS}::test_gsm8k_reward"],
    },
    {
        "name": "math-mathrm-not-unwrapped",
        "why": "\\mathrm{...} / \\mathbf{...} answers are not unwrapped before comparison",
        "file": "megatron_prune/grpo/rewards.py",
        "old": "for command in (\"text\", \"textbf\", \"textrm\", \"mathrm\", \"mathbf\", \"mbox\"):",
        "new": "for command in (\"text\", \"mbox\"):",
        "tests": [f"{REWARDS}::test_math_reward"],
    },
]
