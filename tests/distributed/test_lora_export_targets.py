"""LoRA exports of target subsets, checked in transformers / peft against the LoRA model's own logits.

- tiny (GQA: 4 heads, 2 key/value groups) with adapters on ``linear_qkv`` and ``linear_fc2`` only,
  rank 3 and alpha 5 (scale 5/3), trained and saved at TP=2 with sequence parallelism, on an HF base:
  the merged weights and the PEFT adapters give the model's logits;
- tiny-moe, every layer sparse, adapters on ``linear_qkv`` and the experts' ``linear_fc1`` only: peft
  (transformers' fused expert tensors) maps expert gate_proj/up_proj adapters onto the fused
  ``gate_up_proj`` only beside down_proj adapters, so the export adds zero ones; without them the
  expert adapters were silently dropped on load and the model was the base's MLP.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.dist import run_distributed
from tests.distributed.dpo_harness import SEED
from tests.distributed.test_lora import _peft_logits, perturb_adapters

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5


def export_subset(root: str, *, preset: str, lora: dict, parallel: dict, all_sparse: bool = False) -> dict:
    """A LoRA checkpoint of ``preset`` (random non-zero B) on an HF base, saved at ``parallel``
    and exported merged and as PEFT adapters; the LoRA model's logits. Collective."""
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.hf_convert import comparison_tokens, export_megatron_to_hf, megatron_logits
    from megatron_prune.model.lora import LoRAConfig
    from megatron_prune.model.lora_base import hf_base
    from megatron_prune.model.lora_export import export_merged, export_peft, lora_meta
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import save_checkpoint
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(**parallel)
    arch = get_preset(preset)
    if all_sparse:
        arch = dataclasses.replace(arch, mlp_only_layers=[])
    cfg = LoRAConfig(**lora)
    tokens = comparison_tokens(vocab_size=arch.vocab_size, batch_size=2, seq_length=16, seed=5)
    with model_parallel(par, seed=SEED):
        base = setup_model(arch, par, seed=SEED, trainable=False)
        save_checkpoint(f"{root}/base", iteration=1, model=base, arch=arch)
        export_megatron_to_hf(load_dir=f"{root}/base", hf_out=f"{root}/base_hf")
        model = setup_model(arch, par, seed=SEED, lora=cfg)
        perturb_adapters(model)
        save_checkpoint(f"{root}/lora", iteration=1, model=model, arch=arch,
                        extra_meta=lora_meta(cfg, base=hf_base(f"{root}/base_hf").to_dict()))
        logits = megatron_logits(model, tokens)
        export_merged(load_dir=f"{root}/lora", hf_out=f"{root}/merged")
        export_peft(load_dir=f"{root}/lora", peft_out=f"{root}/peft")
    return dict(logits=logits, tokens=tokens)


def _check(root: str, res: dict) -> dict:
    from megatron_prune.model.hf_convert import compare_logits, hf_logits

    tokens, want = res["tokens"], res["logits"]
    merged = compare_logits(hf_logits(f"{root}/merged", tokens), want)
    peft = compare_logits(_peft_logits(f"{root}/base_hf", f"{root}/peft", tokens), want)
    base = compare_logits(hf_logits(f"{root}/base_hf", tokens), want)
    assert base.max_abs_diff > 100 * TOLERANCE, "the adapters change nothing: the check below proves nothing"
    assert merged.max_abs_diff <= TOLERANCE, f"merged: {merged.summary()}"
    assert peft.max_abs_diff <= TOLERANCE, f"peft: {peft.summary()}"
    with open(f"{root}/peft/adapter_config.json") as f:
        return json.load(f)


def test_qkv_and_fc2_adapters_saved_at_tp2_export_to_the_model(tmp_path):
    root = str(tmp_path)
    res = run_distributed(export_subset, 2, root=root, preset="tiny",
                          lora=dict(rank=3, alpha=5.0, targets="linear_qkv,linear_fc2"),
                          parallel=dict(tensor_model_parallel_size=2, sequence_parallel=True))[0]
    config = _check(root, res)
    assert sorted(config["target_modules"]) == ["down_proj", "k_proj", "q_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"]) == (3, 5.0)


def test_moe_expert_fc1_adapters_without_fc2_load_in_peft(tmp_path):
    from safetensors.torch import load_file

    root = str(tmp_path)
    res = run_distributed(export_subset, 1, root=root, preset="tiny-moe", all_sparse=True,
                          lora=dict(rank=3, alpha=5.0, targets="linear_qkv,linear_fc1"), parallel={})[0]
    config = _check(root, res)
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_file(f"{root}/peft/adapter_model.safetensors")
    down = [k for k in tensors if ".down_proj." in k]
    assert down and all(".mlp.experts." in k and not tensors[k].any() for k in down)
    assert any(tensors[k].any() for k in tensors if ".gate_proj.lora_B" in k)
