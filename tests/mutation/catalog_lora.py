"""Seeded bugs of LoRA on dense models (the adapter arithmetic, its tensor parallelism, the
fresh-adapter and adapter-off guarantees), each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

LORA = "megatron_prune/model/lora.py"
TESTS = "tests/distributed/test_lora.py"
LAYOUTS_2 = f"{TESTS}::test_lora_step_layouts_match_single_rank_2_ranks"
EXPORTS = f"{TESTS}::test_merged_and_peft_exports_match_the_lora_model"
DPO_LAYOUTS = f"{TESTS}::test_lora_step_is_the_same_in_every_dpo_layout"

MUTANTS: list[dict] = [
    {
        "name": "lora-row-dropout-on-the-shared-stream",
        "why": "a row-parallel adapter draws its dropout mask from the stream the TP ranks share: each rank holds "
               "other input columns, yet hidden units j and j + h/tp are always dropped together",
        "file": LORA,
        "old": "        return isinstance(self, RowParallelLinear) or (self.sequence_parallel and not self.explicit_expert_comm)",
        "new": "        return self.sequence_parallel and not self.explicit_expert_comm",
        "tests": ["tests/distributed/test_lora_dropout_masks.py"],
    },
    {
        "name": "pipeline-stages-share-one-seed",
        "why": "every pipeline stage seeds its RNG alike: stage 1's first layer repeats the dropout masks stage 0's "
               "first layer drew",
        "file": "megatron_prune/training/parallel.py",
        "old": "    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()\n",
        "new": "",
        "tests": ["tests/distributed/test_lora_dropout_masks.py"],
    },
    {
        "name": "lora-dropout-per-layer-grad-mode",
        "why": "adapter dropout follows each layer's grad mode: under full recompute the first forward (no_grad) "
               "drops nothing and the recompute in backward does, so the loss and gradients disagree",
        "file": LORA,
        "old": "        training_pass = torch.is_grad_enabled() if _dropout_pass is None else _dropout_pass\n",
        "new": "        training_pass = torch.is_grad_enabled()\n",
        "tests": [f"{TESTS}::test_adapter_dropout_under_full_recompute_is_the_same_step"],
    },
    {
        "name": "lora-pruned-row-scored-without-dropout",
        "why": "branch pruning's pruned responses, run as their own forward-only rows, are scored without adapter "
               "dropout: the loss mixes the kept response of the dropped model with the pruned one of the undropped",
        "file": "megatron_prune/dpo/step.py",
        "old": "            with adapter_dropout_as(not forward_only):",
        "new": "            with contextlib.nullcontext():",
        "tests": [f"{TESTS}::test_adapter_dropout_acts_on_pruned_responses_however_they_run"],
    },
    {
        "name": "lora-pruned-on-prefix-kv-scored-without-dropout",
        "why": "pruned responses run on the training row's stored prompt keys and values (computed under dropout) "
               "are scored without it",
        "file": "megatron_prune/dpo/step.py",
        "old": "    with attend_to_prefix_kv(store), adapter_dropout_as(training), \\\n",
        "new": "    with attend_to_prefix_kv(store), contextlib.nullcontext(), \\\n",
        "tests": [f"{TESTS}::test_adapter_dropout_acts_on_pruned_responses_however_they_run"],
    },
    {
        "name": "lora-up-projection-unscaled",
        "why": "the adapter's product is added without alpha / r, so the model is not the one a merged or PEFT "
               "export describes (the tests use alpha / r = 2)",
        "file": LORA,
        "old": "self.lora_B.t(),\n                           alpha=self.lora_scale)",
        "new": "self.lora_B.t(),\n                           alpha=1.0)",
        "tests": [EXPORTS],
    },
    {
        "name": "lora-row-partial-sums-not-reduced",
        "why": "a row-parallel base's adapter applies B to its rank's partial x A^T instead of the sum over TP",
        "file": LORA,
        "old": "            low = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)\n",
        "new": "            low = partial\n",
        "tests": [LAYOUTS_2],
    },
    {
        "name": "lora-column-a-grad-partial-under-sp",
        "why": "under sequence parallelism the replicated A of a column-parallel base keeps the gradient of its "
               "rank's sequence shard: finalize_model_grads does not sum it over TP",
        "file": LORA,
        "old": "        if module.sequence_parallel:\n            param.sequence_parallel = True\n        return\n",
        "new": "        return\n",
        "tests": [LAYOUTS_2],
    },
    {
        "name": "lora-fresh-b-not-zero",
        "why": "B starts non-zero, so a fresh adapter is not the base model",
        "file": LORA,
        "old": "                sh.data.zero_()\n",
        "new": "                sh.data.fill_(1e-3)\n",
        "tests": [f"{TESTS}::test_fresh_adapter_is_the_base_model"],
    },
    {
        "name": "lora-adapter-off-reference-keeps-adapters",
        "why": "the adapter-off reference runs with the adapters on: DPO's reference and GRPO's KL reference "
               "move with the policy",
        "file": LORA,
        "old": "    for m in modules:\n        m.lora_enabled = False\n",
        "new": "    for m in modules:\n        m.lora_enabled = True\n",
        "tests": [f"{TESTS}::test_adapter_off_reference_is_the_frozen_base",
                  f"{TESTS}::test_grpo_kl_reference_is_the_adapter_off_policy"],
    },
    {
        "name": "lora-shared-pruned-responses-without-adapters",
        "why": "in the shared layout the pruned responses, run on the training pass's stored prompt keys and "
               "values, run with the adapters off: their log-ratios come from the base model, not the policy",
        "file": "megatron_prune/dpo/step.py",
        "old": "    with attend_to_prefix_kv(store), adapter_dropout_as(training), \\\n",
        "new": "    from megatron_prune.model.lora import adapters_disabled\n"
               "    with attend_to_prefix_kv(store), adapters_disabled([model]), \\\n",
        "tests": [DPO_LAYOUTS],
    },
    {
        "name": "lora-dropout-in-forward-only-passes",
        "why": "adapter dropout also acts in the forward-only passes that score for themselves (the reference with "
               "adapters on, GRPO's old log-probs), which run in train mode: their log-probs turn noisy and the PPO "
               "ratio is not 1 at the first update",
        "file": "megatron_prune/model/lora.py",
        "old": "if self.lora_dropout and self.training and training_pass:",
        "new": "if self.lora_dropout and self.training:",
        "tests": ["tests/distributed/test_lora.py::test_adapter_off_reference_is_the_frozen_base"],
    },
    {
        "name": "lora-peft-qkv-b-split-contiguously",
        "why": "the PEFT export splits the fused QKV adapter's B into q/k/v by contiguous row blocks instead of "
               "Megatron's per-query-group interleaved order, so q_proj/k_proj/v_proj get each other's rows",
        "file": "megatron_prune/model/lora_export.py",
        "old": "        b_parts = rule.to_hf(b) if len(names) > 1 else [b]\n",
        "new": "        b_parts = list(b.split([s[0] for s in rule.hf_shapes])) if len(names) > 1 else [b]\n",
        "tests": [EXPORTS],
    },
    {
        "name": "lora-peft-config-alpha-is-rank",
        "why": "the PEFT adapter_config.json gives lora_alpha = r, so peft scales the adapters by 1 instead of "
               "alpha / r",
        "file": "megatron_prune/model/lora_export.py",
        "old": "        \"lora_alpha\": lora[\"alpha\"],\n",
        "new": "        \"lora_alpha\": lora[\"rank\"],\n",
        "tests": [EXPORTS],
    },
    {
        "name": "lora-merged-export-scale-without-rank",
        "why": "the merged export adds alpha * B A instead of (alpha / r) * B A",
        "file": "megatron_prune/model/lora_export.py",
        "old": "    scale = lora[\"alpha\"] / lora[\"rank\"]\n",
        "new": "    scale = lora[\"alpha\"]\n",
        "tests": [EXPORTS],
    },
    {
        "name": "lora-peft-target-modules-of-megatron-names",
        "why": "PEFT's target_modules lists Megatron's module names (linear_qkv ...) instead of the HF ones, so "
               "peft attaches no adapter",
        "file": "megatron_prune/model/lora_export.py",
        "old": "        \"target_modules\": peft_target_modules(arch, lora[\"targets\"]),\n",
        "new": "        \"target_modules\": sorted(lora[\"targets\"]),\n",
        "tests": [EXPORTS],
    },
    {
        "name": "lora-precomputed-ref-load-scored-adapter-off",
        "why": "--ref-mode precomputed under LoRA with --ref-load scores the table with the adapter-off base, not the "
               "--ref-load model, and stores it under that model's key",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "if ref_mode == \"adapter-off\" or (ref_mode == \"precomputed\" and lora_on and not dpo.ref_load):",
        "new": "if ref_mode == \"adapter-off\" or (ref_mode == \"precomputed\" and lora_on):",
        "tests": ["tests/e2e/test_lora_reference.py"],
    },
    {
        "name": "lora-a-init-bound-from-the-rank",
        "why": "A drawn from U(+-1/sqrt(r)) instead of U(+-1/sqrt(in)): adapters start sqrt(in/r) times too large",
        "file": "megatron_prune/model/lora.py",
        "old": "            bound = 1.0 / math.sqrt(shape[1])\n",
        "new": "            bound = 1.0 / math.sqrt(shape[0])\n",
        "tests": ["tests/distributed/test_lora.py::test_fresh_adapters_start_at_b_zero_and_a_uniform_over_the_input_width"],
    },
    {
        "name": "lora-a-init-the-same-in-every-layer",
        "why": "the adapter init is keyed without the layer offset: every layer's A is the same matrix",
        "file": "megatron_prune/model/lora.py",
        "old": "gen = torch.Generator().manual_seed(_seed_for(seed, sh.key, tuple(sh.global_offset[:p])))",
        "new": "gen = torch.Generator().manual_seed(_seed_for(seed, sh.key, ()))",
        "tests": ["tests/distributed/test_lora.py::test_fresh_adapters_start_at_b_zero_and_a_uniform_over_the_input_width"],
    },
    {
        "name": "lora-peft-config-records-no-dropout",
        "why": "the PEFT export's adapter_config.json says lora_dropout 0 whatever --lora-dropout trained with",
        "file": "megatron_prune/model/lora_export.py",
        "old": "        \"lora_dropout\": lora[\"dropout\"],\n",
        "new": "        \"lora_dropout\": 0.0,\n",
        "tests": ["tests/distributed/test_lora.py::test_merged_and_peft_exports_match_the_lora_model"],
    },
    {
        "name": "lora-rank-at-a-width-not-warned",
        "why": "a --lora-rank equal to a targeted linear's narrowest width (a full-rank adapter) passes silently",
        "file": "megatron_prune/training/dead_flags.py",
        "old": "lambda s: s.lora_on and s.lora.rank >= s.lora_narrowest[0],",
        "new": "lambda s: s.lora_on and s.lora.rank > s.lora_narrowest[0],",
        "tests": ["tests/e2e/test_dead_flags.py::test_an_ignored_flag_is_said_in_one_line_and_the_run_goes_on"],
    },
]
