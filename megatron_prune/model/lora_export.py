"""Export a LoRA training checkpoint: merged HF weights, or a PEFT adapter directory.

A LoRA checkpoint (``meta.json`` has a ``lora`` entry) holds the frozen base and the adapters
``<linear>.lora_A`` [r, in] / ``<linear>.lora_B`` [out, r] in Megatron's global layout (saved
at any TP/PP layout; read one layer at a time).

- merged: ``W + (alpha / r) B A`` for every adapted linear, then the usual Megatron -> HF mapping
  (so the fused QKV and gate/up weights are split after merging);
- PEFT: per HF module adapters with PEFT's key names. A fused base (QKV, gate+up) shares one
  input, so every module split from it gets the same ``A``; ``B``'s rows are split exactly like
  the base weight's rows (the interleaved per-group QKV order, the [gate; up] halves).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Iterator

import torch

from megatron_prune.model.arch import ModelArch
from megatron_prune.lora_config import lora_meta  # noqa: F401 (re-exported)
from megatron_prune.model.hf_mapping import EMBED, FC1, FC2, PROJ, QKV, hf_tensors, tensor_rules

logger = logging.getLogger(__name__)

ADAPTED = {"linear_qkv": QKV, "linear_proj": PROJ, "linear_fc1": FC1, "linear_fc2": FC2}
"""LoRA target -> the Megatron weight it adapts."""
PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def adapter_keys(weight_key: str) -> tuple[str, str]:
    base = weight_key.removesuffix(".weight")
    return base + ".lora_A", base + ".lora_B"


def checkpoint_lora(meta: dict) -> dict | None:
    """The ``lora`` record of a checkpoint's metadata, or None for a full-parameter checkpoint."""
    return meta.get("lora")


def _split_metadata(metadata: dict) -> tuple[dict, dict]:
    base = {k: v for k, v in metadata.items() if not k.endswith(ADAPTER_SUFFIXES)}
    adapters = {k: v for k, v in metadata.items() if k.endswith(ADAPTER_SUFFIXES)}
    return base, adapters


def _open(load_dir: str):
    from megatron.core import dist_checkpointing

    from megatron_prune.training.checkpoint import read_meta

    meta = read_meta(load_dir)
    ckpt = meta["path"]
    lora = checkpoint_lora(meta)
    if lora is None:
        raise ValueError(f"{ckpt} holds no LoRA adapters (not trained with --lora-rank); export it without "
                         "--merge-lora / --peft-out")
    dist_dir = os.path.join(ckpt, "dist")
    metadata = dist_checkpointing.load_tensors_metadata(dist_dir)
    base, adapters = _split_metadata(metadata)
    for target in lora["targets"]:
        for key in adapter_keys(ADAPTED[target]):
            if key not in adapters:
                raise ValueError(f"{ckpt}: adapter tensor {key} of target {target} is missing from the checkpoint")
    return meta, ckpt, dist_dir, base, adapters, lora


def _iter_merged(dist_dir: str, *, metadata: dict, arch: ModelArch, scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron_prune.model.hf_convert import _load_layer

    rules = tensor_rules(arch)
    head = [r for r in rules if not r.layered and r.megatron_key != EMBED]
    steps = [([r for r in rules if r.megatron_key == EMBED], None)]
    steps += [([r for r in rules if r.layered], layer) for layer in range(arch.num_layers)]
    steps += [(head, None)]
    for step_rules, layer in steps:
        keys = [r.megatron_key for r in step_rules]
        keys += [k for r in step_rules for k in adapter_keys(r.megatron_key) if k in metadata]
        tensors = _load_layer(dist_dir, metadata=metadata, keys=keys, layer=layer, num_layers=arch.num_layers)
        for rule in step_rules:
            weight = tensors.pop(rule.megatron_key)
            a_key, b_key = adapter_keys(rule.megatron_key)
            if a_key in tensors:
                delta = tensors.pop(b_key).double() @ tensors.pop(a_key).double()
                weight = (weight.double() + scale * delta).to(weight.dtype)
            yield from hf_tensors(rule, layer=layer, tensor=weight).items()


def export_merged(*, load_dir: str, hf_out: str, dtype: str = "auto", max_shard_size: str | int = "5GB",
                  hf_assets: str | None = None) -> list[str]:
    """Write ``base + (alpha/r) B A`` of the newest LoRA checkpoint under ``load_dir`` as an HF
    model directory ``hf_out``; return its files. Collective (all ranks read, rank 0 writes)."""
    from megatron_prune.model.hf_convert import _check_checkpoint_tensors, resolve_dtype, write_hf_directory

    if os.path.exists(hf_out) and (not os.path.isdir(hf_out) or os.listdir(hf_out)):
        raise ValueError(f"--hf-out {hf_out} exists and is not an empty directory")
    meta, ckpt, dist_dir, base, adapters, lora = _open(load_dir)
    arch = ModelArch.from_dict(meta["arch"])
    _check_checkpoint_tensors(base, arch, ckpt)
    out_dtype = base[EMBED].dtype if dtype == "auto" else resolve_dtype(dtype, config={})
    scale = lora["alpha"] / lora["rank"]
    return write_hf_directory(hf_out=hf_out, ckpt=ckpt, arch=arch, out_dtype=out_dtype, hf_assets=hf_assets,
                              max_shard_size=max_shard_size, what=" with merged LoRA adapters",
                              tensors=_iter_merged(dist_dir, metadata={**base, **adapters}, arch=arch, scale=scale))


def peft_tensors(*, dist_dir: str, metadata: dict, arch: ModelArch, targets: list[str]) -> dict[str, torch.Tensor]:
    """PEFT state dict (``base_model.model.<module>.lora_{A,B}.weight``) from a LoRA checkpoint."""
    from megatron_prune.model.hf_convert import _load_layer

    rules = {r.megatron_key: r for r in tensor_rules(arch)}
    out: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        keys = [k for t in targets for k in adapter_keys(ADAPTED[t])]
        tensors = _load_layer(dist_dir, metadata=metadata, keys=keys, layer=layer, num_layers=arch.num_layers)
        for target in targets:
            rule = rules[ADAPTED[target]]
            a_key, b_key = adapter_keys(rule.megatron_key)
            a, b = tensors[a_key], tensors[b_key]
            names = rule.names(layer)
            # B's rows follow the base's rows: split it with the base weight's own Megatron -> HF rule.
            b_parts = rule.to_hf(b) if len(names) > 1 else [b]
            for name, b_part in zip(names, b_parts):
                module = PEFT_PREFIX + name.removesuffix(".weight")
                out[f"{module}.lora_A.weight"] = a.clone().contiguous()
                out[f"{module}.lora_B.weight"] = b_part.clone().contiguous()
    return out


def peft_target_modules(arch: ModelArch, targets: list[str]) -> list[str]:
    rules = {r.megatron_key: r for r in tensor_rules(arch)}
    names = [n for t in targets for n in rules[ADAPTED[t]].names(0)]
    return [n.removesuffix(".weight").rsplit(".", 1)[-1] for n in names]


def export_peft(*, load_dir: str, peft_out: str, dtype: str = "auto", base_model: str | None = None) -> list[str]:
    """Write the adapters of the newest LoRA checkpoint under ``load_dir`` as a PEFT directory
    (``adapter_config.json`` + ``adapter_model.safetensors``). Collective (rank 0 writes)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_prune.model.hf_convert import resolve_dtype
    from megatron_prune.training.parallel import barrier

    if os.path.exists(peft_out) and (not os.path.isdir(peft_out) or os.listdir(peft_out)):
        raise ValueError(f"--peft-out {peft_out} exists and is not an empty directory")
    meta, ckpt, dist_dir, base, adapters, lora = _open(load_dir)
    arch = ModelArch.from_dict(meta["arch"])
    tensors = peft_tensors(dist_dir=dist_dir, metadata=adapters, arch=arch, targets=lora["targets"])
    out_dtype = None if dtype == "auto" else resolve_dtype(dtype, config={})
    if out_dtype is not None:
        tensors = {k: v.to(out_dtype) for k, v in tensors.items()}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": peft_target_modules(arch, lora["targets"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = peft_out.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        if os.path.isdir(peft_out):
            os.rmdir(peft_out)
        os.replace(tmp, peft_out)
        logger.info("exported the LoRA adapters of %s to %s (PEFT format)", ckpt, peft_out)
    barrier()
    return sorted(os.listdir(peft_out))
