"""Seeded bugs of LoRA on mixture-of-experts models (expert adapters, their gradients, checkpoint
layout and merged export), each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

LORA = "megatron_prune/model/lora.py"
EXPORT = "megatron_prune/model/lora_export.py"
TESTS = "tests/distributed/test_lora_moe.py"
EP2 = f"{TESTS}::test_lora_moe_step_at_expert_parallel_2_matches_single_rank"
EP2_TP2 = f"{TESTS}::test_lora_moe_step_at_ep2_x_tp2_sp_matches_single_rank"
MERGED = f"{TESTS}::test_lora_moe_checkpoint_saved_at_ep2_loads_at_ep1_and_exports_merged"
PEFT = f"{TESTS}::test_peft_export_of_a_moe_lora_checkpoint_matches_in_peft"
SUBSETS = "tests/distributed/test_lora_export_targets.py"

MUTANTS: list[dict] = [
    {
        "name": "lora-moe-expert-adapters-in-dense-buffers",
        "why": "expert adapters do not take their base weight's allreduce=False, so Megatron's DDP reduces "
               "them over the whole data-parallel group and sums different experts' gradients at EP > 1",
        "file": LORA,
        "old": '        p.allreduce = getattr(module.weight, "allreduce", True)\n',
        "new": "        p.allreduce = True\n",
        "tests": [EP2],
    },
    {
        "name": "lora-moe-expert-tp-partial-grad-not-summed",
        "why": "the replicated adapter weight of an expert (A of fc1, B of fc2) keeps its gradient partial over "
               "expert TP: nothing sums it",
        "file": LORA,
        "old": "    if module.tp_group.size() <= 1:\n        return\n",
        "new": "    if module.tp_group.size() <= 64:\n        return\n",
        "tests": [EP2_TP2],
    },
    {
        "name": "lora-moe-column-expert-gathers-again",
        "why": "an expert's fc1 adapter gathers its rank-R activation along the sequence although the token "
               "dispatcher already gathered the tokens over expert TP",
        "file": LORA,
        "old": "        if self.explicit_expert_comm:\n            pass  # an expert",
        "new": "        if False:\n            pass  # an expert",
        "tests": [EP2_TP2],
    },
    {
        "name": "lora-moe-row-expert-reduces-again",
        "why": "an expert's fc2 adapter reduce-scatters its partial rank-R products although the dispatcher sums "
               "the expert TP ranks' outputs when it combines them",
        "file": LORA,
        "old": "        if self.explicit_expert_comm:\n            # An expert",
        "new": "        if False:\n            # An expert",
        "tests": [EP2_TP2],
    },
    {
        "name": "lora-moe-expert-fc1-lora-b-not-remapped",
        "why": "an expert's gated fc1 lora_B is saved as the TP ranks' [gate shard; up shard] blocks instead of "
               "the global [gate; up] rows its weight is mapped to",
        "file": LORA,
        "old": "        if self.lora_swiglu:\n",
        "new": "        if self.lora_swiglu and not self.is_expert:\n",
        "tests": [EP2_TP2],
    },
    {
        "name": "lora-moe-merge-reads-preset-experts-whole",
        "why": "the merged export regenerates a preset base's expert-stacked weight as one tensor, not expert by "
               "expert as the layout-independent initialisation made it",
        "file": EXPORT,
        "old": "                          read_base=read_base, whole_experts=megatron_moe)",
        "new": "                          read_base=read_base, whole_experts=True)",
        "tests": [MERGED],
    },
    {
        "name": "lora-moe-peft-b-of-the-next-expert",
        "why": "the PEFT export pairs each expert's A with the next expert's B",
        "file": EXPORT,
        "old": "add(rule, expert, tensors[a_key][expert], tensors[b_key][expert])",
        "new": "add(rule, expert, tensors[a_key][expert], tensors[b_key][(expert + 1) % arch.num_experts])",
        "tests": [PEFT],
    },
    {
        "name": "lora-moe-peft-dense-mlp-check-skipped",
        "why": "a MoE model with dense MLP layers exports PEFT adapters that peft would load without the dense "
               "layers' MLP adapters",
        "file": EXPORT,
        "old": "    if arch.is_moe and dense and mlp_targets:",
        "new": "    if arch.is_moe and dense and mlp_targets and False:",
        "tests": [f"{TESTS}::test_peft_export_of_a_moe_model_with_dense_mlp_layers_is_refused"],
    },
    {
        "name": "lora-moe-peft-expert-down-proj-not-padded",
        "why": "expert gate/up adapters exported without down_proj ones: peft on transformers' fused expert "
               "tensors drops them on load, silently, and the model is the base's MLP",
        "file": EXPORT,
        "old": "    return arch.is_moe and \"linear_fc1\" in targets and \"linear_fc2\" not in targets\n",
        "new": "    return False\n",
        "tests": [f"{SUBSETS}::test_moe_expert_fc1_adapters_without_fc2_load_in_peft"],
    },
]
