"""Seeded bugs of the GRPO / DPPO objective and its resume, each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

OBJECTIVE = "tests/distributed/test_grpo_objective.py"
UNBIASED = f"{OBJECTIVE}::test_dppo_trainer_gradient_is_unbiased_by_exact_enumeration[systematic]"
PLAIN = f"{OBJECTIVE}::test_unpruned_trainer_step_is_plain_grpo"
RESUME = "tests/e2e/test_grpo_resume.py"
ROLLOUT_STATE = f"{OBJECTIVE}::test_state_inside_a_rollout_restores_it_on_every_rank"
DPPO_UNIT = "tests/unit/grpo/test_dppo.py"
SKIP_ZERO = f"{OBJECTIVE}::test_zero_advantage_completions_are_skipped_exactly_without_kl"
SKIP_UNIT = "tests/unit/grpo/test_unbiasedness.py::test_skipping_zero_advantages_keeps_the_estimate_unbiased"
UNBIASED_UNIT = "tests/unit/grpo/test_unbiasedness.py::test_dppo_gradient_is_unbiased_by_exact_enumeration"
ROUTER_LAYOUT = ("tests/distributed/test_moe_router_losses.py::"
                 "test_grpo_router_losses_do_not_depend_on_the_placeholders_a_layout_needs")
MINIBATCHES = f"{OBJECTIVE}::test_minibatch_updates_use_the_rollout_policy_as_old_and_the_minibatch_normaliser"
SEQUENCE = f"{OBJECTIVE}::test_sequence_normalisation_is_the_mean_over_each_completion"
ONE_UPDATE_FLAGS = f"{OBJECTIVE}::test_one_update_per_rollout_and_the_advantage_and_clip_flags"
SAMPLING_FLAGS = f"{OBJECTIVE}::test_each_level_draws_by_its_own_sampling_flag"
MINIBATCH_SLICES = f"{OBJECTIVE}::test_prompt_pruning_leaves_each_minibatch_its_own_slice"
TOP_P = "tests/unit/grpo/test_top_p.py"
SAMPLER_REFERENCE = "tests/unit/grpo/test_sampler.py::test_batched_draws_equal_one_row_at_a_time"
TOP_P_NUCLEUS = f"{TOP_P}::test_top_p_samples_the_renormalised_nucleus"
TOP_P_ABOVE = f"{TOP_P}::test_top_token_above_top_p_is_always_drawn"
CLIP_FRACTION = "tests/unit/grpo/test_loss.py::test_clip_fraction_uses_eps_low_below_and_eps_high_above"
MATH_PROMPTS = "tests/unit/grpo/test_math_prompts.py"
PROMPT_TEMPLATE = f"{MATH_PROMPTS}::test_prompts_are_the_user_turn_with_the_generation_prompt"
PROMPT_TRUNCATION = f"{MATH_PROMPTS}::test_long_prompts_keep_the_head_and_the_tail"

MUTANTS: list[dict] = [
    {
        "name": "grpo-equal-rewards-keep-rounding-advantage",
        "why": "a group of equal fractional rewards keeps its float mean's rounding residue, which the std "
               "scales to an advantage of ~0.06 shared by the whole group",
        "file": "megatron_prune/grpo/advantages.py",
        "old": "    centred = torch.where(zero_variance_groups(rewards)[:, None], 0.0,\n"
               "                          rewards - rewards.mean(dim=1, keepdim=True))\n",
        "new": "    centred = rewards - rewards.mean(dim=1, keepdim=True)\n",
        "tests": ["tests/unit/grpo/test_advantages.py::test_equal_fractional_rewards_give_exactly_zero_advantage"],
    },
    {
        "name": "dppo-keep-weights-uncorrected",
        "why": "KeepDecision.weights gives kept items weight 1 instead of 1/probability",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "return torch.where(self.keep, 1.0 / self.probs, torch.zeros_like(self.probs))",
        "new": "return torch.where(self.keep, torch.ones_like(self.probs), torch.zeros_like(self.probs))",
        "tests": [UNBIASED_UNIT],
    },
    {
        "name": "dppo-combine-drops-prompt-weight",
        "why": "combine_weights returns the completion weights only, without the prompt's 1/p",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "    return prompt_weights[:, None] * completion_weights",
        "new": "    return completion_weights + 0 * prompt_weights[:, None]",
        "tests": [UNBIASED_UNIT],
    },
    {
        "name": "grpo-drops-prompt-weight",
        "why": "the trainer weights kept completions by 1/q only, forgetting the prompt keep probability 1/p",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "weights = combine_weights(prompt_weights=prompt_decision.weights[prompt_decision.keep],",
        "new": "weights = combine_weights(prompt_weights=torch.ones_like(prompt_decision.weights[prompt_decision.keep]),",
        "tests": [UNBIASED],
    },
    {
        "name": "grpo-drops-dppo-weights",
        "why": "kept completions train with weight 1: pruning without importance correction",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "advantage=float(advantages[k, j]), weight=float(weights[k, j]),",
        "new": "advantage=float(advantages[k, j]), weight=1.0,",
        "tests": [UNBIASED],
    },
    {
        "name": "grpo-advantages-over-kept-completions",
        "why": "group advantages recomputed over the kept completions only (they then depend on the keep draws)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "advantage=float(advantages[k, j]), weight=float(weights[k, j]),",
        "new": (
            "advantage=float(group_advantages(rewards[k:k + 1, completion_decision.keep[k]],"
            " config=self.grpo.advantage_config())[0, int(completion_decision.keep[k, :j].sum())]),"
            " weight=float(weights[k, j]),"
        ),
        "tests": [UNBIASED],
    },
    {
        "name": "grpo-normaliser-from-kept-tokens",
        "why": "the loss is divided by the kept completions' token count instead of the unpruned constant",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "normalisers = [float(per_minibatch * tokens_per)] * self.grpo.minibatches",
        "new": "normalisers = [float(max(sum(len(it.completion) for it in mb), 1)) for mb in minibatches]",
        "tests": [UNBIASED],
    },
    {
        "name": "grpo-resume-reuses-a-rollout-made-for-other-flags",
        "why": "a checkpoint saved inside a rollout at --kl-beta 0 resumed with --kl-beta > 0 reuses that rollout, "
               "which has no reference log-probs (the run crashed)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        if changed:\n",
        "new": "        if changed and False:\n",
        "tests": [f"{RESUME}::test_resume_may_turn_the_kl_term_on"],
    },
    {
        "name": "grpo-placeholder-keeps-router-losses",
        "why": "a placeholder microbatch (nothing to train) still adds the MoE routers' load-balancing and z-losses "
               "of its pad rows: a step said to train nothing moves every weight",
        "file": "megatron_prune/grpo/step.py",
        "old": "    with router_loss_scale(model, scale) if scale is not None else contextlib.nullcontext():\n",
        "new": "    with contextlib.nullcontext():\n",
        "tests": ["tests/distributed/test_moe_router_losses.py::test_a_placeholder_microbatch_adds_no_router_loss"],
    },
    {
        "name": "grpo-router-losses-count-padding",
        "why": "the GRPO forward step drops the padding mask: padded rows give other router losses and router "
               "gradients than the same completions packed",
        "file": "megatron_prune/grpo/step.py",
        "old": "segments=batch.segments, padding_mask=batch.padding_mask)",
        "new": "segments=batch.segments)",
        "tests": ["tests/distributed/test_moe_router_losses.py::test_grpo_router_losses_do_not_count_padding"],
    },
    {
        "name": "grpo-router-losses-diluted-by-placeholders",
        "why": "the real microbatches' MoE router losses keep Megatron's 1/(all microbatches) weight, so the "
               "placeholders expert parallelism adds shrink them: the gradient depends on the layout",
        "file": "megatron_prune/grpo/step.py",
        "old": "        router_scale = len(layout.batches) / real if real else 0.0\n",
        "new": "        router_scale = 1.0 if real else 0.0\n",
        "tests": [ROUTER_LAYOUT],
    },
    {
        "name": "router-loss-metric-divided-after-the-dp-mean",
        "why": "the reported router losses average the ranks' sums and divide by this rank's microbatch count: "
               "ranks with different counts report different numbers, none of them the loss that was added",
        "file": "megatron_prune/model/moe.py",
        "old": ("        total /= max(num_microbatches, 1)  # ranks may run different numbers of microbatches\n"
                "        if dist.is_initialized():\n"
                "            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())\n"
                "            total /= parallel_state.get_data_parallel_world_size()\n"
                "        out[metric] = coeffs[metric] * float(total)\n"),
        "new": ("        if dist.is_initialized():\n"
                "            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())\n"
                "            total /= parallel_state.get_data_parallel_world_size()\n"
                "        out[metric] = coeffs[metric] * float(total) / max(num_microbatches, 1)\n"),
        "tests": [ROUTER_LAYOUT],
    },
    {
        "name": "grpo-discarded-rollout-skips-its-prompts",
        "why": "a resume that cannot reuse the saved rollout keeps the sampler and prompt history from after it: "
               "the rollout's prompts are skipped and its discarded rewards stay in the history",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        source = (state.get(\"before_rollout\") or state) if \"rollout\" in state and not reused else state\n",
        "new": "        source = state\n",
        "tests": [f"{OBJECTIVE}::test_a_rollout_a_resume_cannot_reuse_is_drawn_again"],
    },
    {
        "name": "grpo-reused-rollout-forgets-the-state-before-it",
        "why": "a resume that reuses the saved rollout saves again inside it without the state from before it, "
               "so a later resume that cannot reuse it skips its prompts",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "            self._before_buffer = state.get(\"before_rollout\")  # for the next save inside this rollout\n",
        "new": "",
        "tests": [f"{OBJECTIVE}::test_a_rollout_a_resume_cannot_reuse_is_drawn_again"],
    },
    {
        "name": "grpo-resume-sampler-not-restored",
        "why": "a resumed GRPO run starts the prompt order from the beginning instead of the saved position",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "            self.sampler.load_state_dict(source[\"sampler\"])",
        "new": "            pass",
        "tests": [RESUME],
    },
    {
        "name": "grpo-resume-history-not-restored",
        "why": "a resumed DPPO run forgets the prompt history, so its prompt keep probabilities and draws change",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "            self.pruner.load_state_dict(source[\"dppo\"])",
        "new": "            pass",
        "tests": [RESUME],
    },
    {
        "name": "grpo-resume-rollout-not-restored",
        "why": "a run resumed inside a rollout rolls out again with the current policy instead of reusing the saved rollout",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "            self.buffer = self._load_buffer(state[\"rollout\"])",
        "new": "            pass",
        "tests": [ROLLOUT_STATE],
    },
    {
        "name": "dppo-systematic-keyed-by-position",
        "why": "a group's systematic uniform is keyed by its position in the batch, not its prompt id: another "
               "batch order, split or layout draws differently",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "uniform = keep_uniform(seed=seed, step=step, level=COMPLETION_LEVEL, item_id=prompt_id)",
        "new": "uniform = keep_uniform(seed=seed, step=step, level=COMPLETION_LEVEL, item_id=k)",
        "tests": [f"{DPPO_UNIT}::test_systematic_draws_are_a_pure_function_of_seed_step_and_prompt_id"],
    },
    {
        "name": "dppo-systematic-step-not-in-key",
        "why": "the group uniform ignores the step: every step repeats the same keep pattern for a prompt",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "uniform = keep_uniform(seed=seed, step=step, level=COMPLETION_LEVEL, item_id=prompt_id)",
        "new": "uniform = keep_uniform(seed=seed, step=0, level=COMPLETION_LEVEL, item_id=prompt_id)",
        "tests": [f"{DPPO_UNIT}::test_systematic_draws_are_a_pure_function_of_seed_step_and_prompt_id"],
    },
    {
        "name": "dppo-systematic-not-ordered-by-advantage",
        "why": "systematic completion draws walk the group in index order: still unbiased, but the kept "
               "completions no longer balance the group's advantages (the variance reduction is lost)",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "order = sorted(range(len(row)), key=lambda j: (row[j], j))",
        "new": "order = list(range(len(row)))",
        "tests": [f"{DPPO_UNIT}::test_systematic_keeps_each_groups_weighted_advantages_balanced"],
    },
    {
        "name": "dppo-systematic-prompt-order-by-position",
        "why": "systematic prompt draws walk the batch in its given order: the decisions depend on the batch layout",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "order = sorted(range(len(ids)), key=lambda k: (float(probs[k]), repr(ids[k])))",
        "new": "order = list(range(len(ids)))",
        "tests": [f"{DPPO_UNIT}::test_systematic_prompt_draws_do_not_depend_on_batch_order"],
    },
    {
        "name": "grpo-kl-term-sign",
        "why": "the KL penalty is subtracted from the loss: the policy is pushed away from the reference",
        "file": "megatron_prune/grpo/loss.py",
        "old": "loss = loss + kl_loss",
        "new": "loss = loss - kl_loss",
        "tests": [PLAIN],
    },
    {
        "name": "grpo-resume-logprobs-not-gathered",
        "why": "a checkpoint inside a rollout keeps only the old/reference log-probs that rank 0 scored: other "
               "data-parallel ranks resume with the current policy's log-probs (ratio 1, no clipping)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        if dist.is_initialized() and dist.get_world_size() > 1:\n            parts: list",
        "new": "        if False:\n            parts: list",
        "tests": [ROLLOUT_STATE],
    },
    {
        "name": "grpo-skips-zero-advantage-under-kl",
        "why": "zero-advantage completions are skipped with the KL term on, which drops their KL gradient",
        "file": "megatron_prune/grpo/config.py",
        "old": "skip_zero_advantage=self.skip_zero_advantage and kl_beta == 0,",
        "new": "skip_zero_advantage=self.skip_zero_advantage,",
        "tests": [PLAIN],
    },
    {
        "name": "dppo-skips-small-advantages",
        "why": "the skip takes small nonzero advantages for zero: those completions are never trained (biased)",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "    zero = scores == 0\n",
        "new": "    zero = scores < 0.6\n",
        "tests": [SKIP_UNIT],
    },
    {
        "name": "dppo-skip-rate-not-rebalanced",
        "why": "with zero advantages skipped, the other completions are still pruned at the full rate r_o",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "rate = max(0.0, (config.completion_prune_rate * n - zeros) / (n - zeros))",
        "new": "rate = config.completion_prune_rate",
        "tests": [SKIP_UNIT],
    },
    {
        "name": "grpo-skip-drops-nonzero-group-members",
        "why": "the trainer drops every completion of a group that has a zero advantage, not only the zeros",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "    probs = torch.zeros(scores.shape, dtype=torch.float64)\n    n, zeros",
        "new": "    zero = zero | zero.any(dim=-1, keepdim=True)\n    probs = torch.zeros(scores.shape, dtype=torch.float64)\n    n, zeros",
        "tests": [SKIP_UNIT, SKIP_ZERO],
    },
    {
        "name": "grpo-placeholders-left-out-of-the-loss-scale",
        "why": "the update scales its loss by the microbatches that hold items, not by all the schedule runs "
               "(placeholders under the interleaved schedule or expert parallelism divide it too)",
        "file": "megatron_prune/grpo/step.py",
        "old": "        scale = len(layout.batches) * dp\n",
        "new": "        scale = sum(1 for b in layout.batches if b.items) * dp\n",
        "tests": ["tests/distributed/test_grpo.py::test_layouts_equal_single_rank"],
    },
    {
        "name": "kv-cache-pipeline-logprobs-not-broadcast",
        "why": "under pipeline parallelism the KV-cached sampler broadcasts the drawn tokens but not their "
               "log-probs: the stages before the last record zeros as the sampling log-probs",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "drawn, logprobs = _broadcast_from_last_stage(drawn), _broadcast_from_last_stage(logprobs)",
        "new": "drawn = _broadcast_from_last_stage(drawn)",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_mixed_length_cached_batches_under_pipeline_parallelism"],
    },
    {
        "name": "kv-cache-sequence-parallel-not-restored",
        "why": "the KV-cached sampler switches sequence parallelism off for its forwards and leaves it off: "
               "every later training pass all-reduces full sequences instead of splitting them",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "            setattr(module, flag, value)",
        "new": "            pass",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_mixed_length_cached_batches_under_sequence_parallelism"],
    },
    {
        "name": "kv-cache-interleaved-chunks-share-one-iterator",
        "why": "under the interleaved schedule the KV-cached sampler gives all model chunks one iterator "
               "of its microbatches: a chunk reads another microbatch's rows and cache",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "iterators = [iter(microbatches) for _ in model] if len(model) > 1 else iter(microbatches)",
        "new": "iterators = iter(microbatches)",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_mixed_length_cached_batches_under_pipeline_parallelism"],
    },
    {
        "name": "sampler-chunks-reuse-the-first-generators",
        "why": "when a decoding step's rows are sampled in several chunks, every chunk draws from the first "
               "chunk's generators: a row's token depends on how many rows share the step",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "generators[start : start + rows],",
        "new": "generators[0 : rows],",
        "tests": [SAMPLER_REFERENCE],
    },
    {
        "name": "sampler-uniform-not-scaled-by-the-nucleus-mass",
        "why": "the uniform is not scaled by the kept mass, so under top-p a draw beyond the nucleus falls on "
               "its last token far more often than it should",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "for g in generators])[:, None] * total",
        "new": "for g in generators])[:, None]",
        "tests": [SAMPLER_REFERENCE],
    },
    {
        "name": "top-p-sorts-ascending",
        "why": "the nucleus is built from the least likely tokens (probabilities sorted ascending)",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "probs, order = probs.sort(dim=-1, descending=True, stable=True)",
        "new": "probs, order = probs.sort(dim=-1, descending=False, stable=True)",
        "tests": [TOP_P_NUCLEUS],
    },
    {
        "name": "top-p-drops-crossing-token",
        "why": "the token whose cumulative mass crosses top_p is dropped (empty nucleus when the top token alone "
               "exceeds top_p)",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "keep = probs.cumsum(-1) - probs < top_p",
        "new": "keep = probs.cumsum(-1) < top_p",
        "tests": [TOP_P_NUCLEUS, TOP_P_ABOVE],
    },
    {
        "name": "top-p-logprob-not-renormalised",
        "why": "the returned sampling log-prob is the full-softmax one, not renormalised over the nucleus",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "logprobs = [math.log(c / t) for c, t in zip(chosen, total[:, 0].tolist())]",
        "new": "logprobs = [math.log(c) for c, t in zip(chosen, total[:, 0].tolist())]",
        "tests": [TOP_P_NUCLEUS, TOP_P_ABOVE],
    },
    {
        "name": "grpo-clip-fraction-low-uses-eps-high",
        "why": "clip_fraction counts negative-advantage tokens below 1 - clip_eps_high instead of 1 - clip_eps_low",
        "file": "megatron_prune/grpo/loss.py",
        "old": "(advantages < 0) & (ratio < 1.0 - config.clip_eps_low)",
        "new": "(advantages < 0) & (ratio < 1.0 - config.clip_eps_high)",
        "tests": [CLIP_FRACTION],
    },
    {
        "name": "grpo-math-truncation-drops-head",
        "why": "long GSM8K/MATH prompts are left-truncated without keeping BOS and the template head",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "kept = truncate_prompt(ids, max_length=max_prompt_length, keep_head=head,",
        "new": "kept = truncate_prompt(ids, max_length=max_prompt_length, keep_head=0,",
        "tests": [PROMPT_TRUNCATION],
    },
    {
        "name": "grpo-math-prompt-no-generation-prompt",
        "why": "GSM8K/MATH prompts lack the assistant header, so the model continues the user turn",
        "file": "megatron_prune/grpo/trainer.py",
        "old": 'ids = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt_text}], tokenize=True)',
        "new": ('ids = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt_text}],'
                " add_generation_prompt=False, tokenize=True)"),
        "tests": [PROMPT_TEMPLATE],
    },
    {
        "name": "grpo-minibatch-normaliser-whole-batch",
        "why": "each minibatch update is divided by the whole batch's normaliser: a k-times-too-small gradient",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "normalisers = [float(per_minibatch * tokens_per)] * self.grpo.minibatches",
        "new": "normalisers = [float(len(ids) * tokens_per)] * self.grpo.minibatches",
        "tests": [MINIBATCHES],
    },
    {
        "name": "grpo-old-logprobs-only-with-ppo-epochs",
        "why": "old log-probs are scored only for --ppo-epochs > 1: with --minibatches > 1 alone the later "
               "minibatches take the already-updated policy as old (ratio 1, the clip never binds)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        if self.grpo.updates_per_rollout > 1:",
        "new": "        if self.grpo.ppo_epochs > 1:",
        "tests": [MINIBATCHES],
    },
    {
        "name": "grpo-sequence-normaliser-counts-tokens",
        "why": "--loss-normalization sequence still divides by prompts x G x max_new_tokens instead of prompts x G",
        "file": "megatron_prune/grpo/trainer.py",
        "old": 'tokens_per = G * (self.grpo.max_new_tokens if self.grpo.loss_normalization == "constant" else 1)',
        "new": "tokens_per = G * self.grpo.max_new_tokens",
        "tests": [SEQUENCE],
    },
    {
        "name": "grpo-sequence-mean-not-per-sequence",
        "why": "--loss-normalization sequence sums each completion's tokens instead of taking their mean (no 1/len_j)",
        "file": "megatron_prune/grpo/step.py",
        "old": 'seq_weights = [it.weight / (len(it.completion) if self.s.normalization == "sequence" else 1.0) '
               'for it in items]',
        "new": "seq_weights = [it.weight for it in items]",
        "tests": [SEQUENCE],
    },
    {
        "name": "reward-grades-the-reasoning",
        "why": "the math rewards read the whole completion of a reasoning model: a draft answer inside <think>, "
               "or the last number of reasoning cut by --max-new-tokens, is graded as its answer",
        "file": "megatron_prune/grpo/rewards.py",
        "old": "    return None if THINK_OPEN in completion_text else completion_text",
        "new": "    return completion_text",
        "tests": ["tests/unit/grpo/test_rewards.py::test_gsm8k_grades_what_follows_the_reasoning"],
    },
    {
        "name": "gsm8k-fraction-read-as-a-part",
        "why": "the GSM8K reward reads 3/4 as 4 (or 3 after ####), \\frac{3}{4} in a box as its denominator: "
               "a wrong answer whose part equals the reference scores 1",
        "file": "megatron_prune/grpo/rewards.py",
        "old": "(?:/\\d+)?(?:[eE][-+]?\\d+)?\")",
        "new": "\")",
        "tests": ["tests/unit/grpo/test_rewards.py::test_gsm8k_reward"],
    },
    {
        "name": "math-left-side-variable-ignored",
        "why": "the MATH reward drops any one-letter left-hand side: the asymptote x = 3 matches y = 3",
        "file": "megatron_prune/grpo/rewards.py",
        "old": "    if all(sides) and len({re.sub(r\"[{}\\s]\", \"\", side.group(1)) for side in sides}) > 1:\n",
        "new": "    if False:\n",
        "tests": ["tests/unit/grpo/test_rewards.py::test_math_reward"],
    },
    {
        "name": "reward-grades-reasoning-reopened-after-the-answer",
        "why": "a completion that closes its reasoning, answers, then opens <think> again is graded on the "
               "draft it writes there",
        "file": "megatron_prune/grpo/rewards.py",
        "old": "        return completion_text.rsplit(THINK_CLOSE, 1)[1].split(THINK_OPEN, 1)[0]\n",
        "new": "        return completion_text.rsplit(THINK_CLOSE, 1)[1]\n",
        "tests": ["tests/unit/grpo/test_rewards.py::test_math_grades_what_follows_the_reasoning"],
    },
    {
        "name": "gsm8k-latex-spacing-splits-numbers",
        "why": "the GSM8K reward reads a boxed 12\\,500 or 1,\\!000 as 500 or 0 and -\\$5 as 5: a wrong answer equal "
               "to a part of the written number scores 1",
        "file": "megatron_prune/grpo/rewards.py",
        "old": '    return _LATEX_SPACE.sub("", text.translate(MINUS_SIGNS)).replace("\\\\$", "").replace("$", "")',
        "new": '    return text.translate(MINUS_SIGNS).replace("$", "")',
        "tests": ["tests/unit/grpo/test_reward_latex_numbers.py::test_the_reward_credits_the_written_number_not_a_part_of_it"],
    },
    {
        "name": "math-frac-sign-dropped",
        "why": "the MATH reward parses -\\frac{a}{b} as +a/b: a negative fraction matches the positive reference",
        "file": "megatron_prune/grpo/rewards.py",
        "old": '    return -value if sign == "-" else value',
        "new": "    return value",
        "tests": ["tests/unit/grpo/test_rewards.py::test_math_negative_fraction_keeps_its_sign"],
    },
    {
        "name": "dppo-history-decay-swapped",
        "why": "the prompt history's moving average weights the old score by 1 - decay (the same only at 0.5)",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "score = self.decay * self._scores[key] + (1.0 - self.decay) * score",
        "new": "score = (1.0 - self.decay) * self._scores[key] + self.decay * score",
        "tests": ["tests/unit/grpo/test_dppo.py::test_history_ema_weights_the_old_score_by_decay"],
    },
    {
        "name": "dppo-informative-always-one",
        "why": "--dppo-history-score informative scores a zero-variance group 1: prompt pruning stops preferring "
               "informative prompts",
        "file": "megatron_prune/grpo/dppo.py",
        "old": 'return std if self.score_kind == "std" else float(std > 0)',
        "new": 'return std if self.score_kind == "std" else float(std >= 0)',
        "tests": ["tests/unit/grpo/test_dppo.py::test_informative_score_is_zero_for_a_zero_variance_group"],
    },
    {
        "name": "dppo-pass-rate-forgets-nothing",
        "why": "--dppo-history-score pass-rate adds each group's passes to undecayed counts: old groups of a "
               "policy long gone weigh as much as the last one",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "passes = self.decay * passes + rewards.sum().item()",
        "new": "passes = passes + rewards.sum().item()",
        "tests": ["tests/unit/grpo/test_dppo.py::test_pass_rate_score_is_the_posterior_probability_that_a_group_varies"],
    },
    {
        "name": "dppo-pass-rate-ignores-all-fail-groups",
        "why": "--dppo-history-score pass-rate scores only all-pass groups as uninformative: prompts the policy "
               "always fails are kept as if they taught something",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "return max(0.0, 1.0 - all_pass - all_fail)",
        "new": "return max(0.0, 1.0 - all_pass)",
        "tests": ["tests/unit/grpo/test_dppo.py::test_pass_rate_score_is_the_posterior_probability_that_a_group_varies"],
    },
    {
        "name": "dppo-pass-rate-resume-drops-counts",
        "why": "a resumed pass-rate history keeps the scores but restarts the counts, so its next update "
               "forgets every group before the checkpoint",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "self._evidence = {key: (float(p), float(f)) for key, (p, f) in zip(keys, state[\"evidence\"])}",
        "new": "self._evidence = {}",
        "tests": ["tests/unit/grpo/test_dppo.py::test_pass_rate_history_resumes_with_its_counts"],
    },
    {
        "name": "rollout-uncached-logits-one-past-the-end",
        "why": "the uncached sampler reads each row's logits one position past its last token (a padding "
               "position), so every draw conditions on a pad token",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "last = torch.tensor([len(seq) - 1 for seq in chunk], dtype=torch.long)",
        "new": "last = torch.tensor([len(seq) for seq in chunk], dtype=torch.long)",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_mixed_length_cached_batches_give_the_uncached_tokens"],
    },
    {
        "name": "rollout-uncached-does-not-stop-at-eos",
        "why": "the uncached sampler compares the last token with the pad id instead of EOS, so completions "
               "run on past their EOS up to max_new_tokens",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "active = [i for i in active if not settings.ends(completions[i].tokens[-1])]",
        "new": "active = [i for i in active if completions[i].tokens[-1] != settings.pad_id]",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_mixed_length_cached_batches_give_the_uncached_tokens",
                  "tests/unit/grpo/test_rollout_cache.py::test_completions_end_at_their_first_eos_cached_or_not"],
    },
    {
        "name": "rollout-cached-does-not-stop-at-eos",
        "why": "the KV-cached sampler ends a row only at max_new_tokens, not at its EOS",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "done[r] = settings.ends(token) or len(completion.tokens) == settings.max_new_tokens",
        "new": "done[r] = len(completion.tokens) == settings.max_new_tokens",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_completions_end_at_their_first_eos_cached_or_not"],
    },
    {
        "name": "rollout-stops-at-eos-only",
        "why": "only the tokenizer's eos ends a completion: a model whose generation config ends turns with "
               "another token writes past its end of turn, and that text is trained and scored",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "        return token == self.eos_id or token in self.stop_ids",
        "new": "        return token == self.eos_id",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_completions_end_at_their_first_eos_cached_or_not"],
    },
    {
        "name": "rollout-cached-first-draw-one-step-late",
        "why": "the KV-cached sampler starts drawing for a row one forward after its prompt ended, feeding a pad "
               "token in between",
        "file": "megatron_prune/grpo/rollout.py",
        "old": "sampling = [r for r in range(b) if not done[r] and fed >= lengths[r]]",
        "new": "sampling = [r for r in range(b) if not done[r] and fed > lengths[r]]",
        "tests": ["tests/unit/grpo/test_rollout_cache.py::test_mixed_length_cached_batches_give_the_uncached_tokens"],
    },
    {
        "name": "dppo-raised-floor-ignores-kept-positives",
        "why": "at a rate the scaling rule cannot reach, the zero scores' raised floor is solved without "
               "subtracting the positive scores' certain keeps, so the expected prune rate misses the target",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "raised = (target * flat.numel() - (flat.numel() - num_zero)) / num_zero",
        "new": "raised = target * flat.numel() / num_zero",
        "tests": [f"{DPPO_UNIT}::test_low_rate_with_many_zero_scores_raises_their_floor_exactly"],
    },
    {
        "name": "dppo-bisection-bracket-from-the-largest-score",
        "why": "the bisection's upper bracket is the multiplier that brings the largest score to 1, not the "
               "smallest: rates that need small positive scores kept with certainty are not reached",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "high = math.log(floor), -log_relative[positive].min().item()",
        "new": "high = math.log(floor), -log_relative[positive].max().item()",
        "tests": [DPPO_UNIT],
    },
    {
        "name": "dppo-bisection-halves-c-not-log-c",
        "why": "the keep-probability multiplier is halved from the start, not first narrowed on a log scale: once "
               "a prompt's score has decayed to 1e-60 of the others, 200 halvings leave c far off and almost "
               "nothing is pruned",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "        if high - low <= math.log(2.0):\n",
        "new": "        if True:\n",
        "tests": [f"{DPPO_UNIT}::test_the_target_is_met_when_a_score_has_decayed_to_almost_nothing"],
    },
    {
        "name": "dppo-unseen-prompts-score-zero",
        "why": "a prompt with no history gets score 0 (kept at the floor) instead of +inf (always kept)",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "fill = math.inf if unseen is None else float(unseen)",
        "new": "fill = 0.0 if unseen is None else float(unseen)",
        "tests": [f"{DPPO_UNIT}::test_prompt_level_uses_history_and_keeps_unseen_prompts"],
    },
    {
        "name": "dppo-expected-rate-is-keep-rate",
        "why": "the logged expected prune rate is the mean keep probability (1 - rate)",
        "file": "megatron_prune/grpo/dppo.py",
        "old": "return 1.0 - self.probs.mean().item() if self.probs.numel() else 0.0",
        "new": "return self.probs.mean().item() if self.probs.numel() else 0.0",
        "tests": [DPPO_UNIT],
    },
    {
        "name": "rollout-reused-after-its-prompts-rerender",
        "why": "a resume inside a rollout reuses the saved rollout although this run renders its prompts to other "
               "tokens (--chat-template-kwargs, another tokenizer): it trains on prompts the run no longer makes",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        if self._rerendered_prompts(saved):\n",
        "new": "        if False and self._rerendered_prompts(saved):\n",
        "tests": ["tests/e2e/test_grpo_resume.py::test_a_resume_that_renders_the_prompts_otherwise_rolls_out_again"],
    },
    {
        "name": "clipped-completions-warned-at-every-rollout",
        "why": "the warning about completions cut by --max-new-tokens repeats at every rollout of a long run",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        self._warned_clipped = True\n",
        "new": "",
        "tests": ["tests/e2e/test_grpo_resume.py::test_a_resume_that_renders_the_prompts_otherwise_rolls_out_again"],
    },
    {
        "name": "grpo-single-update-ratio-not-detached",
        "why": "with one update per rollout (the default) the old log-probs fall back to the policy's own; "
               "without detach the ratio is 1 with gradient 0 and the policy never learns",
        "file": "megatron_prune/grpo/step.py",
        "old": "it.old_logprobs.to(device) if it.old_logprobs is not None else values.detach()",
        "new": "it.old_logprobs.to(device) if it.old_logprobs is not None else values",
        "tests": [ONE_UPDATE_FLAGS],
    },
    {
        "name": "grpo-clip-eps-high-ignored",
        "why": "--clip-eps-high (clip-higher) silently takes --clip-eps-low's value",
        "file": "megatron_prune/grpo/config.py",
        "old": "clip_eps_high=self.clip_eps_high, kl_beta=self.kl_beta",
        "new": "clip_eps_high=self.clip_eps_low, kl_beta=self.kl_beta",
        "tests": [ONE_UPDATE_FLAGS],
    },
    {
        "name": "grpo-advantage-flags-ignored",
        "why": "--no-std-normalization and --advantage-std sample silently do nothing in the trainer",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "advantages = group_advantages(rewards, config=self.grpo.advantage_config())",
        "new": "advantages = group_advantages(rewards)",
        "tests": [ONE_UPDATE_FLAGS],
    },
    {
        "name": "dppo-sampling-flags-swapped",
        "why": "--dppo-sampling and --dppo-prompt-sampling rule each other's level (still unbiased: only "
               "the variance changes, so only a test of the draws sees it)",
        "file": "megatron_prune/grpo/config.py",
        "old": "sampling=self.sampling, prompt_sampling=self.prompt_sampling,",
        "new": "sampling=self.prompt_sampling, prompt_sampling=self.sampling,",
        "tests": [SAMPLING_FLAGS],
    },
    {
        "name": "grpo-minibatch-slot-by-kept-position",
        "why": "with --minibatches > 1 and prompt pruning, minibatches are cut from the kept prompts, so a "
               "minibatch trains another slice's prompts under its own normaliser",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "slot = {i: position // per_minibatch for position, i in enumerate(ids)}",
        "new": "slot = {i: position // per_minibatch for position, i in enumerate(kept_ids)}",
        "tests": [MINIBATCH_SLICES],
    },
    {
        "name": "grpo-rows-not-a-multiple-of-tp",
        "why": "GRPO rows padded to 8 tokens only: at TP = 3, 6 or 16 sequence parallelism cannot split them",
        "file": "megatron_prune/grpo/step.py",
        "old": "    multiple = math.lcm(settings.pad_multiple, tp)\n",
        "new": "    multiple = settings.pad_multiple\n",
        "tests": ["tests/unit/test_schedule_and_lengths.py::test_grpo_rows_split_over_any_tensor_parallel_size"],
    },
    {
        "name": "grpo-token-metrics-mean-of-microbatch-means",
        "why": "clip_fraction, ratio_mean and kl reported as a mean of microbatch means, not over the trained tokens",
        "file": "megatron_prune/grpo/step.py",
        "old": "report.update({name: _sum_count(stats[name], n) for name in AVERAGED if name in stats})",
        "new": "report.update({name: _sum_count(stats[name], 1.0) for name in AVERAGED if name in stats})",
        "tests": [f"{OBJECTIVE}::test_per_token_metrics_do_not_depend_on_the_microbatch_split"],
    },
    {
        "name": "rollout-reused-at-another-loss-normalization",
        "why": "a resume inside a rollout reuses it at another --loss-normalization (its normalisers, completions or groups "
               "were made for the old value)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "                \"--loss-normalization\": self.grpo.loss_normalization,\n",
        "new": "",
        "tests": [f"{OBJECTIVE}::test_a_rollout_a_resume_cannot_reuse_is_drawn_again"],
    },
    {
        "name": "rollout-reused-at-another-max-new-tokens",
        "why": "a resume inside a rollout reuses it at another --max-new-tokens (its normalisers, completions or groups "
               "were made for the old value)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "                \"--max-new-tokens\": self.grpo.max_new_tokens,\n",
        "new": "",
        "tests": [f"{OBJECTIVE}::test_a_rollout_a_resume_cannot_reuse_is_drawn_again"],
    },
    {
        "name": "rollout-reused-at-another-group-size",
        "why": "a resume inside a rollout reuses it at another --group-size (its normalisers, completions or groups "
               "were made for the old value)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "                \"--group-size\": self.grpo.group_size,\n",
        "new": "",
        "tests": [f"{OBJECTIVE}::test_a_rollout_a_resume_cannot_reuse_is_drawn_again"],
    },
    {
        "name": "rollout-reused-at-another-temperature",
        "why": "a resume inside a rollout reuses it at another --temperature (its old log-probs were taken at the old one)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "                \"--temperature\": self.grpo.temperature,\n",
        "new": "",
        "tests": [f"{OBJECTIVE}::test_a_rollout_a_resume_cannot_reuse_is_drawn_again"],
    },
    {
        "name": "rollout-state-before-it-not-saved",
        "why": "a checkpoint inside a rollout keeps no sampler and history from before it, so a resume that cannot "
               "reuse the rollout draws the next prompts and skips the rollout's own",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "            state[\"before_rollout\"] = self._before_buffer  # a resume",
        "new": "            pass  # a resume",
        "tests": [f"{OBJECTIVE}::test_a_rollout_a_resume_cannot_reuse_is_drawn_again"],
    },
    {
        "name": "bench-grad-variance-drops-logprobs",
        "why": "bench_grpo's gradient-variance probe rebuilds each kept item without its stored log-probs, so any "
               "--kl-beta > 0 run of a pruned mode crashes",
        "file": "tools/bench_grpo.py",
        "old": "                    chosen.append(dataclasses.replace(it, weight=float(weights[r, it.index])))",
        "new": "                    chosen.append(type(it)(prompt_id=it.prompt_id, index=it.index, prompt=it.prompt, "
               "completion=it.completion, advantage=it.advantage, weight=float(weights[r, it.index])))",
        "tests": ["tests/e2e/test_bench_grpo.py::test_tensor_parallel_with_kl"],
    },
    {
        "name": "grpo-prompt-truncation-keeps-a-cut-character",
        "why": "a GRPO prompt cut from the left inside a multi-token character starts with that character's "
               "orphan bytes (decoded: U+FFFD), input the model never sees at inference",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "keep_head=head, decode=tokenizer.decode)",
        "new": "keep_head=head)",
        "tests": ["tests/unit/grpo/test_math_prompts.py::test_a_prompt_cut_inside_a_character_starts_after_it"],
    },
]
