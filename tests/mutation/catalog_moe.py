"""Seeded bugs of the mixture-of-experts wiring (router, its losses, expert parallelism, MoE configs), each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

ARCH = "tests/unit/model/test_moe_arch.py"
HFMAP = "tests/unit/model/test_hf_mapping.py"
FLAGS = "tests/unit/model/test_moe_session_flags.py"
GRPO_MASK = "tests/unit/model/test_moe_grpo_padding_mask.py"
CONV = "tests/distributed/test_moe_conversion.py"
ROUTER = "tests/distributed/test_moe_router_losses.py"
MOE = "tests/distributed/test_moe.py"
EMPTY_SHARE = f"{MOE}::test_grpo_expert_parallel_ranks_run_every_pass_together_with_an_empty_share"

MUTANTS: list[dict] = [
    {
        "name": "moe-router-pre-softmax-ignores-norm-topk-prob",
        "why": "the router always renormalises the top-k probabilities: a Qwen3-MoE with norm_topk_prob=false "
               "(softmax over all experts, then top-k) weights its experts differently from transformers",
        "file": "megatron_prune/model/moe.py",
        "old": "        moe_router_pre_softmax=not arch.norm_topk_prob,\n",
        "new": "        moe_router_pre_softmax=False,\n",
        "tests": [f"{ARCH}::test_router_weights_follow_norm_topk_prob",
                  f"{CONV}::test_moe_logits_match_transformers"],
    },
    {
        "name": "moe-hf-num-experts-key-ignored",
        "why": "only transformers-5's num_local_experts is read: a config.json written by transformers 4 "
               "(num_experts, e.g. Qwen3-30B-A3B's own) is refused as 'needs num_experts > 0'",
        "file": "megatron_prune/model/arch.py",
        "old": '    num_experts = config.get("num_experts") or config.get("num_local_experts")\n',
        "new": '    num_experts = config.get("num_local_experts")\n',
        "tests": [f"{ARCH}::test_transformers_4_expert_count_key_is_read"],
    },
    {
        "name": "moe-hf-norm-topk-default-true",
        "why": "a qwen3_moe config.json without norm_topk_prob is read as renormalised top-k; transformers' "
               "default is false",
        "file": "megatron_prune/model/arch.py",
        "old": '        norm_topk_prob=bool(config.get("norm_topk_prob", False)),\n',
        "new": '        norm_topk_prob=bool(config.get("norm_topk_prob", True)),\n',
        "tests": [f"{ARCH}::test_missing_norm_topk_prob_is_read_as_transformers_reads_it"],
    },
    {
        "name": "moe-export-config-drops-norm-topk-prob",
        "why": "an export without the original config.json (a preset such as tiny-moe) writes no norm_topk_prob: "
               "transformers reads false, so the exported model weights its experts differently from the trained one",
        "file": "megatron_prune/model/hf_mapping.py",
        "old": "moe_intermediate_size=arch.moe_intermediate_size, norm_topk_prob=arch.norm_topk_prob,",
        "new": "moe_intermediate_size=arch.moe_intermediate_size,",
        "tests": [f"{HFMAP}::test_config_made_from_arch_describes_the_same_model[qwen3-moe]"],
    },
    {
        "name": "moe-z-coeff-not-validated",
        "why": "only --moe-aux-loss-coeff is checked: a negative or NaN --moe-z-loss-coeff trains the router "
               "logits to grow (or NaNs every gradient) without a word",
        "file": "megatron_prune/model/moe.py",
        "old": '    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):\n',
        "new": '    for name in ("moe_aux_loss_coeff",):\n',
        "tests": [f"{ARCH}::test_bad_moe_layouts_are_refused", FLAGS],
    },
    {
        "name": "moe-cli-token-dispatcher-dropped",
        "why": "--moe-token-dispatcher never reaches the ParallelConfig: allgather is silently alltoall, and "
               "EP>1 with allgather is not refused",
        "file": "megatron_prune/training/session.py",
        "old": "        moe_token_dispatcher=model.moe_token_dispatcher,\n",
        "new": "",
        "tests": [FLAGS],
    },
    {
        "name": "moe-z-loss-tracked-in-no-grad-passes",
        "why": "the group-mean z-loss router computes and tracks its loss in no-grad forward passes too (the "
               "policy's forward-only passes at TP>1 with padding): the reported moe_z_loss counts them",
        "file": "megatron_prune/model/moe.py",
        "old": "                or not torch.is_grad_enabled() or self.calculate_per_token_loss):\n",
        "new": "                or self.calculate_per_token_loss):\n",
        "tests": [f"{ROUTER}::test_forward_only_passes_add_no_router_loss_at_tensor_parallel_2"],
    },
    {
        "name": "moe-grpo-padding-mask-drops-first-token",
        "why": "GRPO's router padding mask marks each sequence's first token as padding: the routers' "
               "load-balancing and z-losses skip every prompt's first token",
        "file": "megatron_prune/grpo/step.py",
        "old": "            padding_mask[r, offset : offset + unit.length] = False\n",
        "new": "            padding_mask[r, offset + 1 : offset + unit.length] = False\n",
        "tests": [GRPO_MASK],
    },
    {
        "name": "moe-grpo-ref-score-skipped-without-items",
        "why": "under EP a rank whose share of a minibatch is empty skips the reference pass its EP peer "
               "runs: the MoE all-to-all hangs",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        if self.grpo.kl_beta > 0:\n            for items in minibatches:\n"
               "                if self._mine(items) or _expert_parallel():",
        "new": "        if self.grpo.kl_beta > 0:\n            for items in minibatches:\n"
               "                if self._mine(items):",
        "tests": [EMPTY_SHARE],
    },
    {
        "name": "moe-grpo-old-score-skipped-without-items",
        "why": "under EP a rank whose share of a minibatch is empty skips the old-log-prob pass its EP peer "
               "runs: the MoE all-to-all hangs",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "        if self.grpo.updates_per_rollout > 1:\n            for items in minibatches:\n"
               "                if self._mine(items) or _expert_parallel():",
        "new": "        if self.grpo.updates_per_rollout > 1:\n            for items in minibatches:\n"
               "                if self._mine(items):",
        "tests": [EMPTY_SHARE],
    },
]
