"""Export a LoRA training checkpoint: merged HF weights, or a PEFT adapter directory.

A LoRA checkpoint (``meta.json`` has a ``lora`` entry) holds the adapters ``<linear>.lora_A``
[r, in] / ``<linear>.lora_B`` [out, r] in Megatron's global layout (saved at any TP/PP layout;
read one layer at a time) and records its frozen base (:mod:`megatron_prune.model.lora_base`),
which is read from there (an HF directory, or a preset regenerated from its seed).

- merged: ``W + (alpha / r) B A`` for every adapted linear, then the usual Megatron -> HF mapping
  (so the fused QKV and gate/up weights are split after merging); on a mixture-of-experts model
  every expert's ``B A`` is merged into that expert's weights;
- PEFT: per HF module adapters with PEFT's key names. A fused base (QKV, gate+up) shares one
  input, so every module split from it gets the same ``A``; ``B``'s rows are split exactly like
  the base weight's rows (the interleaved per-group QKV order, the [gate; up] halves); on a
  mixture-of-experts model, per expert (``mlp.experts.<e>.gate_proj`` ...), except where the model
  also has dense MLP layers with adapters (refused: peft would drop those on load); expert
  ``gate_proj``/``up_proj`` adapters without ``down_proj`` ones get zero ``down_proj`` adapters
  (peft, on transformers' fused expert tensors, loads the former only beside the latter).
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
from megatron_prune.model.hf_mapping import hf_tensors, tensor_rules

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def adapter_keys(weight_key: str) -> tuple[str, str]:
    base = weight_key.removesuffix(".weight")
    return base + ".lora_A", base + ".lora_B"


def checkpoint_lora(meta: dict) -> dict | None:
    """The ``lora`` record of a checkpoint's metadata, or None for a full-parameter checkpoint."""
    return meta.get("lora")


def check_peft_export(meta: dict) -> None:
    """Raise ValueError where a PEFT export of the checkpoint's adapters would not load as trained.

    peft, on transformers' fused mixture-of-experts models, takes every ``gate_proj``/``up_proj``/
    ``down_proj`` target for the fused expert tensors, so on a model that also has dense MLP
    layers, those layers' MLP adapters would be silently dropped on load.
    """
    arch = ModelArch.from_dict(meta["arch"])
    lora = checkpoint_lora(meta) or {}
    dense = [i for i, sparse in enumerate(arch.moe_layer_pattern()) if not sparse]
    mlp_targets = sorted({"linear_fc1", "linear_fc2"} & set(lora.get("targets", ())))
    if arch.is_moe and dense and mlp_targets:
        raise ValueError(
            f"--peft-out: {meta['path']} is a mixture-of-experts model with dense MLP layers {dense} and "
            f"{'/'.join(mlp_targets)} adapters; peft maps every gate_proj/up_proj/down_proj target of such a model "
            "onto its fused expert tensors, so the dense layers' MLP adapters would be lost on load. Write merged "
            "HF weights with --hf-out DIR --merge-lora instead"
        )


def _adapted_weight_keys(arch: ModelArch, targets: list[str]) -> list[str]:
    """The checkpoint weight keys the LoRA ``targets`` adapt (per layer and stacked over the experts
    on a mixture-of-experts model)."""
    keys = [r.megatron_key for r in tensor_rules(arch) if r.megatron_key.endswith(".weight")]
    return [k for k in keys if k.removesuffix(".weight").rsplit(".", 1)[-1] in targets]


def _open(load_dir: str, base=None):
    """Metadata, adapter tensors and the checked base (``base``: a BaseSource found by the caller,
    else the recorded one) of the newest LoRA checkpoint under ``load_dir``."""
    from megatron.core import dist_checkpointing

    from megatron_prune.model.lora_base import META_KEY, resolve_base
    from megatron_prune.training.checkpoint import is_optimizer_key, read_meta

    meta = read_meta(load_dir)
    ckpt = meta["path"]
    lora = checkpoint_lora(meta)
    if lora is None:
        raise ValueError(f"{ckpt} holds no LoRA adapters (not trained with --lora-rank); export it without "
                         "--merge-lora / --peft-out")
    if base is None:
        base = resolve_base(meta.get(META_KEY), ckpt=ckpt, override=None, flag="--base-hf")
    dist_dir = os.path.join(ckpt, "dist")
    metadata = dist_checkpointing.load_tensors_metadata(dist_dir)
    adapters = {k: v for k, v in metadata.items() if k.endswith(ADAPTER_SUFFIXES) and not is_optimizer_key(k)}
    for weight_key in _adapted_weight_keys(ModelArch.from_dict(meta["arch"]), lora["targets"]):
        for key in adapter_keys(weight_key):
            if key not in adapters:
                raise ValueError(f"{ckpt}: adapter tensor {key} is missing from the checkpoint")
    return meta, ckpt, dist_dir, base, adapters, lora


def _per_key_reader(ckpt: str, *, arch: ModelArch):
    """``read(megatron_key, None)``: one whole tensor of a Megatron checkpoint at a time (a MoE
    model keys its layers one by one, so a tensor is at most one layer's). Collective."""
    from megatron.core import dist_checkpointing

    from megatron_prune.model.hf_convert import load_layer

    dist_dir = os.path.join(ckpt, "dist")
    metadata = dist_checkpointing.load_tensors_metadata(dist_dir)

    def read(key: str, layer: int | None) -> torch.Tensor:
        assert layer is None, "a MoE checkpoint has no layer-stacked keys"
        return load_layer(dist_dir, metadata=metadata, keys=[key], layer=None, num_layers=arch.num_layers)[key]

    return read


def _read_experts(read_base, key: str, *, arch: ModelArch, whole: bool) -> torch.Tensor:
    """A MoE layer's expert-stacked base tensor [E, ...]: read ``whole`` (a Megatron checkpoint keeps
    it so), else expert by expert (an HF base, a preset)."""
    if whole:
        return read_base(key, None)
    return torch.stack([read_base(key, expert) for expert in range(arch.num_experts)])


def _iter_merged(dist_dir: str, *, adapters: dict, arch: ModelArch, scale: float, read_base,
                 out_dtype: torch.dtype, whole_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron_prune.model.hf_convert import export_steps, load_layer

    for step_rules, layer in export_steps(arch):
        keys = [k for r in step_rules for k in adapter_keys(r.megatron_key) if k in adapters]
        tensors = (load_layer(dist_dir, metadata=adapters, keys=keys, layer=layer, num_layers=arch.num_layers)
                   if keys else {})
        for rule in step_rules:
            experts = rule.stack == "expert"
            weight = (_read_experts(read_base, rule.megatron_key, arch=arch, whole=whole_experts) if experts
                      else read_base(rule.megatron_key, layer))
            a_key, b_key = adapter_keys(rule.megatron_key)
            if a_key in tensors:
                # Expert-stacked adapters ([E, out, r] @ [E, r, in]) merge expert by expert.
                delta = tensors.pop(b_key).double() @ tensors.pop(a_key).double()
                weight = weight.double() + scale * delta
            weight = weight.to(out_dtype)
            if experts:
                for expert in range(arch.num_experts):
                    yield from hf_tensors(rule, layer=expert, tensor=weight[expert]).items()
            else:
                yield from hf_tensors(rule, layer=layer, tensor=weight).items()


def export_merged(*, load_dir: str, hf_out: str, dtype: str = "auto", max_shard_size: str | int = "5GB",
                  hf_assets: str | None = None, base=None) -> list[str]:
    """Write ``base + (alpha/r) B A`` of the newest LoRA checkpoint under ``load_dir`` as an HF
    model directory ``hf_out``; return its files. The base weights come from ``base`` (a checked
    :class:`~megatron_prune.model.lora_base.BaseSource`), else from the base the checkpoint
    records. ``dtype`` auto keeps the adapters' (the training weights') dtype. Collective (all
    ranks read, rank 0 writes)."""
    from megatron_prune.model.hf_convert import check_output_dir, find_hf_assets, resolve_dtype, write_hf_directory
    from megatron_prune.model.lora_base import base_tensor_reader

    check_output_dir(hf_out, flag="--hf-out")
    meta, ckpt, dist_dir, base, adapters, lora = _open(load_dir, base)
    arch = ModelArch.from_dict(meta["arch"])
    out_dtype = next(iter(adapters.values())).dtype if dtype == "auto" else resolve_dtype(dtype, config={})
    if hf_assets is None and find_hf_assets(ckpt) is None and base.kind == "hf":
        hf_assets = base.path  # the base's own config and tokenizer
    elif hf_assets is None and find_hf_assets(ckpt) is None and base.kind == "megatron":
        hf_assets = find_hf_assets(base.path)  # kept next to a converted base
    scale = lora["alpha"] / lora["rank"]
    megatron_moe = base.kind == "megatron" and arch.is_moe
    read_base = _per_key_reader(base.path, arch=arch) if megatron_moe else base_tensor_reader(base, arch=arch)
    merged = _iter_merged(dist_dir, adapters=adapters, arch=arch, scale=scale, out_dtype=out_dtype,
                          read_base=read_base, whole_experts=megatron_moe)
    return write_hf_directory(hf_out=hf_out, ckpt=ckpt, arch=arch, out_dtype=out_dtype, hf_assets=hf_assets,
                              max_shard_size=max_shard_size, what=" with merged LoRA adapters", tensors=merged)


def peft_tensors(*, dist_dir: str, metadata: dict, arch: ModelArch, targets: list[str]) -> dict[str, torch.Tensor]:
    """PEFT state dict (``base_model.model.<module>.lora_{A,B}.weight``) from a LoRA checkpoint.

    On a mixture-of-experts model each expert's adapters are written under that expert's own
    HF modules (``mlp.experts.<e>.{gate,up,down}_proj``), the per-expert layout PEFT reads and,
    under transformers' fused expert tensors, fuses on load itself.
    """
    from megatron_prune.model.hf_convert import load_layer

    adapted = set(_adapted_weight_keys(arch, targets))
    rules = [r for r in tensor_rules(arch) if r.megatron_key in adapted]
    out: dict[str, torch.Tensor] = {}

    def add(rule, index: int | None, a: torch.Tensor, b: torch.Tensor) -> None:
        names = rule.names(index)
        # B's rows follow the base's rows: split it with the base weight's own Megatron -> HF rule.
        b_parts = rule.to_hf(b) if len(names) > 1 else [b]
        for name, b_part in zip(names, b_parts):
            module = PEFT_PREFIX + name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = a.clone().contiguous()
            out[f"{module}.lora_B.weight"] = b_part.clone().contiguous()

    stacked = [r for r in rules if r.layered]
    for layer in range(arch.num_layers) if stacked else ():
        keys = [k for r in stacked for k in adapter_keys(r.megatron_key)]
        tensors = load_layer(dist_dir, metadata=metadata, keys=keys, layer=layer, num_layers=arch.num_layers)
        for rule in stacked:
            a_key, b_key = adapter_keys(rule.megatron_key)
            add(rule, layer, tensors[a_key], tensors[b_key])
    for rule in (r for r in rules if not r.layered):  # a MoE model keys its layers one by one
        a_key, b_key = adapter_keys(rule.megatron_key)
        tensors = load_layer(dist_dir, metadata=metadata, keys=[a_key, b_key], layer=None,
                              num_layers=arch.num_layers)
        if rule.stack == "expert":
            for expert in range(arch.num_experts):
                add(rule, expert, tensors[a_key][expert], tensors[b_key][expert])
        else:
            add(rule, None, tensors[a_key], tensors[b_key])
    if _pads_expert_down_proj(arch, targets):
        a = next(t for k, t in out.items() if k.endswith(".lora_A.weight"))
        for rule in (r for r in tensor_rules(arch) if r.stack == "expert" and _target_of(r) == "linear_fc2"):
            for expert in range(arch.num_experts):
                add(rule, expert, a.new_zeros(a.shape[0], rule.shape[1]), a.new_zeros(rule.shape[0], a.shape[0]))
    return out


def _target_of(rule) -> str:
    """The LoRA target (``linear_fc1`` ...) a rule's Megatron key names."""
    return rule.megatron_key.removesuffix(".weight").rsplit(".", 1)[-1]


def _pads_expert_down_proj(arch: ModelArch, targets) -> bool:
    """Whether the PEFT export adds zero expert ``down_proj`` adapters: peft, on transformers'
    fused expert tensors, maps expert ``gate_proj``/``up_proj`` adapters to the fused
    ``gate_up_proj`` only where ``down_proj`` has adapters too, and silently drops them otherwise.
    Zero adapters add nothing to the model."""
    return arch.is_moe and "linear_fc1" in targets and "linear_fc2" not in targets


def peft_target_modules(arch: ModelArch, targets: list[str]) -> list[str]:
    """PEFT's ``target_modules``: the HF module names (last component) the adapters sit on."""
    adapted = set(_adapted_weight_keys(arch, targets))
    names = {n.removesuffix(".weight").rsplit(".", 1)[-1]
             for r in tensor_rules(arch) if r.megatron_key in adapted
             for n in r.names(0 if r.stack is not None else None)}
    return sorted(names | ({"down_proj"} if _pads_expert_down_proj(arch, targets) else set()))


def export_peft(*, load_dir: str, peft_out: str, dtype: str = "auto", base=None) -> list[str]:
    """Write the adapters of the newest LoRA checkpoint under ``load_dir`` as a PEFT directory
    (``adapter_config.json`` + ``adapter_model.safetensors``) whose ``base_model_name_or_path``
    is the HF base (``base``, else the recorded one). Collective (rank 0 writes)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_prune.model.hf_convert import check_output_dir, removed_on_failure, resolve_dtype
    from megatron_prune.training.parallel import barrier

    check_output_dir(peft_out, flag="--peft-out")
    meta, ckpt, dist_dir, base, adapters, lora = _open(load_dir, base)
    check_peft_export(meta)
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
        "base_model_name_or_path": base.path if base.kind == "hf" else None,
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = peft_out.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with removed_on_failure(tmp, writer=True):
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
