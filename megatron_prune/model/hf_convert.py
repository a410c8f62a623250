"""HF <-> Megatron checkpoint conversion and the numerical check that proves it.

- :func:`convert_hf_to_megatron`: an HF directory (config.json + safetensors, one file or
  sharded) -> a Megatron dist checkpoint (``training.checkpoint`` format, iteration 0) that loads at
  any TP x PP x DP layout. The architecture is recorded in ``meta.json``; config.json and the
  tokenizer files are copied to ``SAVE/hf_assets``.
- :func:`export_megatron_to_hf`: any of our checkpoints (converted or trained) -> an HF directory
  that ``transformers`` loads, streaming one layer at a time.
- :func:`compare_hf_and_megatron`: same tokens through the HF model and the Megatron model at a
  layout; max |delta logits|, KL(HF || Megatron), top-1/top-5 agreement.

The tensor mapping itself is :mod:`megatron_prune.model.hf_mapping`. Megatron is imported inside
the functions that need it, so the reader/writer helpers stay light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

from megatron_prune.data.tokenizer import HF_TOKENIZER_FILES
from megatron_prune.model.arch import ModelArch, arch_difference, read_hf_config_file
from megatron_prune.model.hf_mapping import (
    EMBED,
    HF_EMBED,
    arch_from_hf_config,
    check_hf_tensors,
    check_tied_lm_head,
    expected_hf_shapes,
    hf_config_from_arch,
    hf_tensors,
    PerExpertView,
    megatron_shapes,
    megatron_tensor,
    TensorRule,
    padded_vocab_size,
    tensor_rules,
)

if TYPE_CHECKING:
    from megatron_prune.model.provider import ParallelConfig

logger = logging.getLogger(__name__)

ASSETS_DIR = "hf_assets"
# Everything of an HF model directory except the weights: config, tokenizer, chat template,
# generation defaults, licence and card.
ASSET_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "*.jinja",
    "LICENSE*",
    "NOTICE*",
    "README.md",
    "USE_POLICY.md",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --- reading HF directories ------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    return read_hf_config_file(os.path.join(hf_dir, "config.json"), flag="--hf-dir")


def read_hf_arch(hf_dir: str) -> ModelArch:
    """Checked architecture of an HF directory (unsupported types and fields raise ValueError)."""
    return arch_from_hf_config(read_hf_config(hf_dir), source=os.path.join(hf_dir, "config.json"))


@contextlib.contextmanager
def safe_open_checked(path: str):
    """safetensors' ``safe_open`` whose errors (a truncated or foreign file) name the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


def _weight_files(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path."""
    index = os.path.join(hf_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map") or {}
        except (ValueError, AttributeError) as exc:  # not JSON, or JSON that is not an object
            raise ValueError(f"{index}: not a safetensors index ({exc})") from None
        if not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} (listed in {index}) not found")
        return files
    single = os.path.join(hf_dir, SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        with safe_open_checked(single) as f:
            return {name: single for name in f.keys()}
    legacy = [n for n in os.listdir(hf_dir) if n.startswith("pytorch_model") and n.endswith(".bin")]
    hint = (" (found PyTorch .bin weights: re-save them with save_pretrained(..., safe_serialization=True))"
            if legacy else "")
    raise FileNotFoundError(f"{hf_dir}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}{hint}")


class HFCheckpoint(Mapping):
    """Lazy, read-only view of an HF directory's safetensors weights.

    Nothing is read until a tensor is asked for; each access opens its shard, copies that one
    tensor out and closes the file again, so no mapping of the (possibly huge) shards stays
    resident. Shapes and dtypes come from the file headers.
    """

    def __init__(self, hf_dir: str) -> None:
        self.hf_dir = hf_dir
        self._files = _weight_files(hf_dir)

    @contextlib.contextmanager
    def _open(self, name: str):
        with safe_open_checked(self._files[name]) as f:
            yield f

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(name)
        with self._open(name) as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def files(self) -> list[str]:
        return sorted(set(self._files.values()))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for path in self.files():
            with safe_open_checked(path) as f:
                shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if self._files.get(n) == path})
        return shapes

    def dtype(self, name: str) -> torch.dtype:
        with self._open(name) as f:
            code = f.get_slice(name).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{self._files[name]}: tensor {name} has unsupported dtype {code}")
        return _SAFETENSORS_DTYPES[code]

    def close(self) -> None:
        """Nothing stays open between accesses; kept so the class works as a context manager."""

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def copy_hf_assets(src: str, dst: str, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy config and tokenizer files (never weights) from ``src`` to ``dst``; return their names."""
    os.makedirs(dst, exist_ok=True)
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name in skip:
            continue
        if os.path.isfile(path) and any(fnmatch.fnmatch(name, p) for p in ASSET_PATTERNS):
            shutil.copy2(path, os.path.join(dst, name))
            copied.append(name)
    return copied


def resolve_dtype(flag: str, *, config: dict[str, Any], hf: HFCheckpoint | None = None) -> torch.dtype:
    """``fp32`` / ``bf16``, or ``auto``: bf16 when the HF model is bf16, fp32 otherwise (fp16 is upcast)."""
    if flag in _DTYPES:
        return _DTYPES[flag]
    if flag != "auto":
        raise ValueError(f"--dtype must be auto, fp32 or bf16, got {flag!r}")
    declared = config.get("dtype") or config.get("torch_dtype")
    if declared is None and hf is not None:
        declared = _DTYPE_NAMES.get(hf.dtype(HF_EMBED))
    return torch.bfloat16 if declared == "bfloat16" else torch.float32


# --- HF -> Megatron ----------------------------------------------------------------------------


@torch.no_grad()
def fill_model_from_hf(chunks: list[torch.nn.Module], *, hf: Mapping[str, torch.Tensor], arch: ModelArch) -> None:
    """Copy this rank's shard of every parameter from HF tensors (any layout, any rank).

    Each whole tensor is built for one layer at a time and sliced with Megatron's own
    sharded-state-dict map. Parameters start as NaN, so one that no rule reaches is caught.
    """
    from megatron_prune.model.init import global_slice, iter_sharded_tensors

    rules = {r.megatron_key: r for r in tensor_rules(arch)}
    last: tuple[Any, torch.Tensor | None] = (None, None)
    for chunk in chunks:
        for p in chunk.parameters():
            p.fill_(float("nan"))
        for sh in iter_sharded_tensors(chunk.sharded_state_dict()):
            if sh.data is None or not torch.is_floating_point(sh.data):
                continue
            if sh.key not in rules:
                raise RuntimeError(f"model tensor {sh.key} has no HF mapping (hf_mapping.tensor_rules)")
            layer = sh.global_offset[0] if sh.prepend_axis_num else None
            if last[0] != (sh.key, layer):
                last = ((sh.key, layer), megatron_tensor(rules[sh.key], layer=layer, hf=hf))
            whole = last[1]
            assert tuple(whole.shape) == tuple(sh.global_shape[sh.prepend_axis_num:]), (
                f"{sh.key}: mapped shape {tuple(whole.shape)} != model's {tuple(sh.global_shape)}"
            )
            sh.data.copy_(global_slice(sh, whole).to(sh.data.dtype))
        for name, p in chunk.named_parameters():
            if torch.isnan(p).any():
                raise RuntimeError(f"parameter {name} was not filled from the HF checkpoint")


def hf_weights(checkpoint: HFCheckpoint, arch: ModelArch) -> Mapping[str, torch.Tensor]:
    """The tensors of ``checkpoint`` under the per-expert names the mapping reads (a MoE model's
    fused expert layout is split on access); other models' tensors as they are."""
    return PerExpertView(checkpoint, arch) if arch.is_moe else checkpoint


def checked_hf_weights(checkpoint: HFCheckpoint, arch: ModelArch, *, source: str) -> Mapping[str, torch.Tensor]:
    """:func:`hf_weights` after the converter's checks: every tensor ``arch`` needs, with its shape,
    and no other (the file headers), and a tied model's stored ``lm_head.weight`` (if any) equal to
    the embedding (those two tensors, when both are stored)."""
    hf = hf_weights(checkpoint, arch)
    check_hf_tensors(hf.shapes(), arch, source=source)
    check_tied_lm_head(hf, arch, source=source)
    return hf


def check_hf_weights(hf_dir: str, arch: ModelArch) -> None:
    """:func:`checked_hf_weights` of ``hf_dir``; cheap enough to run before any rank starts."""
    with HFCheckpoint(hf_dir) as checkpoint:
        checked_hf_weights(checkpoint, arch, source=hf_dir)


@torch.no_grad()
def fill_model_from_hf_dir(chunks: list[torch.nn.Module], *, hf_dir: str, arch: ModelArch) -> None:
    """:func:`fill_model_from_hf` from an HF directory, after the converter's checks."""
    modules = [c.module if hasattr(c, "module") else c for c in chunks]
    with HFCheckpoint(hf_dir) as checkpoint:
        fill_model_from_hf(modules, hf=checked_hf_weights(checkpoint, arch, source=hf_dir), arch=arch)


def check_save_dir(save_dir: str) -> None:
    """The converter's ``--save`` is a new directory, or one that holds no checkpoint yet."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"--save {save_dir} exists and is not a directory; choose a new directory")
    from megatron_prune.training.checkpoint import holds_checkpoint

    # A save a kill left unfinished (iter_*.tmp) is no checkpoint: the converter's save replaces it.
    if holds_checkpoint(save_dir):
        taken = sorted(n for n in os.listdir(save_dir) if n.startswith("iter_") and n[5:].isdigit())
        raise ValueError(f"--save {save_dir} already holds checkpoints ({', '.join(taken[:3])}); "
                         "choose a new directory")


def convert_hf_to_megatron(
    *,
    hf_dir: str,
    save_dir: str,
    dtype: str = "auto",
    parallel: ParallelConfig | None = None,
) -> str:
    """Convert an HF directory into a Megatron dist checkpoint under ``save_dir``; return its path.

    Collective: every rank calls it (torch.distributed started); each rank builds and fills only
    its own part of the model at ``parallel`` (default TP=1, PP=1) and reads only the HF tensors of
    its layers. The checkpoint reshards to any layout on load.
    """
    config = read_hf_config(hf_dir)
    arch = read_hf_arch(hf_dir)
    check_save_dir(save_dir)
    import torch.distributed as dist

    from megatron_prune.model.provider import ParallelConfig, build_model_chunks
    from megatron_prune.training.checkpoint import save_checkpoint
    from megatron_prune.training.parallel import barrier, model_parallel

    with HFCheckpoint(hf_dir) as checkpoint:
        hf = checked_hf_weights(checkpoint, arch, source=hf_dir)
        torch_dtype = resolve_dtype(dtype, config=config, hf=checkpoint)
        # Every weight is overwritten from the HF tensors (a weight left unfilled is an error below), so
        # Megatron's initialisation and its full-size fp32 copy would only add to the peak memory.
        parallel = dataclasses.replace(parallel or ParallelConfig(), bf16=torch_dtype == torch.bfloat16,
                                       perform_initialization=False)
        assets = os.path.join(save_dir, ASSETS_DIR)
        if not dist.is_initialized() or dist.get_rank() == 0:
            copied = copy_hf_assets(hf_dir, assets)
            logger.info("copied %s to %s", ", ".join(copied), assets)
            if not set(copied) & set(HF_TOKENIZER_FILES):
                logger.warning("%s holds no tokenizer (none of %s): the trainers will need --tokenizer to read "
                               "text data, and an export will have no tokenizer", hf_dir, ", ".join(HF_TOKENIZER_FILES))
        barrier()
        meta = {
            "hf_conversion": {
                "source": os.path.abspath(hf_dir),
                "model_type": arch.model_type,
                "dtype": _DTYPE_NAMES[torch_dtype],
                "vocab_size": arch.vocab_size,
                "padded_vocab_size": padded_vocab_size(arch.vocab_size),
                "hf_assets": ASSETS_DIR,
            }
        }
        with model_parallel(parallel):
            chunks = build_model_chunks(arch, parallel)
            for chunk in chunks:
                chunk.eval()
                chunk.requires_grad_(False)
            fill_model_from_hf(chunks, hf=hf, arch=arch)
            path = save_checkpoint(save_dir, iteration=0, model=chunks, arch=arch, extra_meta=meta)
    logger.info("converted %s (%s, %s) to %s", hf_dir, arch.model_type, _DTYPE_NAMES[torch_dtype], path)
    return path


# --- Megatron -> HF ----------------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"`` (decimal), ``"4GiB"`` (binary), ``"500MB"`` or a plain integer."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB, 4GiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = {"K": 1, "M": 2, "G": 3, "T": 4}.get(unit[0], 0)
    base = 1024 if "I" in unit else 1000
    return int(number * base**power)


@dataclass
class ShardPlan:
    """Which safetensors file each HF tensor goes to."""

    file_of: dict[str, str]
    total_size: int

    @property
    def files(self) -> list[str]:
        return sorted(set(self.file_of.values()))


def plan_shards(shapes: dict[str, tuple[int, ...]], *, dtype: torch.dtype, max_shard_bytes: int) -> ShardPlan:
    """Greedy split, in checkpoint order, into files of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups: list[list[str]] = [[]]
    size, total = 0, 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
        total += nbytes
    if len(groups) == 1:
        return ShardPlan(file_of={n: SAFETENSORS_SINGLE for n in groups[0]}, total_size=total)
    n = len(groups)
    file_of = {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, group in enumerate(groups) for name in group}
    return ShardPlan(file_of=file_of, total_size=total)


class ShardWriter:
    """Writes each planned safetensors file as soon as all of its tensors have arrived."""

    def __init__(self, out_dir: str, plan: ShardPlan) -> None:
        self.out_dir, self.plan = out_dir, plan
        self._pending = {f: {n for n, g in plan.file_of.items() if g == f} for f in plan.files}
        self._buffers: dict[str, dict[str, torch.Tensor]] = {f: {} for f in plan.files}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        file = self.plan.file_of[name]
        self._buffers[file][name] = tensor.contiguous()
        self._pending[file].discard(name)
        if not self._pending[file]:
            save_file(self._buffers.pop(file), os.path.join(self.out_dir, file), metadata={"format": "pt"})

    def finish(self) -> list[str]:
        unwritten = sorted(f for f, names in self._pending.items() if names)
        assert not unwritten, f"tensors never produced for {unwritten}"
        if len(self.plan.files) > 1:
            index = {"metadata": {"total_size": self.plan.total_size}, "weight_map": self.plan.file_of}
            with open(os.path.join(self.out_dir, SAFETENSORS_INDEX), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        return self.plan.files


def assets_beside(ckpt_path: str, *, with_config: bool = False) -> str | None:
    """The ``hf_assets/`` kept with a checkpoint: inside ``ckpt_path`` (a save folder), else beside
    it (``ckpt_path`` is one iteration folder); with ``with_config``, only one holding config.json."""
    for where in (ckpt_path, os.path.dirname(os.path.abspath(ckpt_path))):
        candidate = os.path.join(where, ASSETS_DIR)
        if os.path.isfile(os.path.join(candidate, "config.json")) if with_config else os.path.isdir(candidate):
            return candidate
    return None


def find_hf_assets(ckpt_path: str, *, explicit: str | None = None) -> str | None:
    """The HF assets directory for a checkpoint: ``explicit``, else next to the checkpoint."""
    if explicit:
        if not os.path.isfile(os.path.join(explicit, "config.json")):
            raise FileNotFoundError(f"--hf-assets {explicit}: no config.json there")
        return explicit
    return assets_beside(ckpt_path, with_config=True)


def export_config(arch: ModelArch, *, assets: str | None, dtype: torch.dtype) -> dict[str, Any]:
    """The original config.json (checked against ``arch``) with its dtype set, or one made from ``arch``."""
    name = _DTYPE_NAMES[dtype]
    if assets is None:
        return hf_config_from_arch(arch, dtype=name)
    source = os.path.join(assets, "config.json")
    config = read_hf_config(assets)
    described = arch_from_hf_config(config, source=source)
    if described != arch:
        raise ValueError(f"{source} describes a different model than the checkpoint: it has "
                         f"{arch_difference(described.to_dict(), arch.to_dict())} (the checkpoint's "
                         "values in parentheses); pass the right --hf-assets")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = name
    return config


def load_layer(dist_dir: str, *, metadata: dict, keys: list[str], layer: int | None, num_layers: int) -> dict[str, torch.Tensor]:
    """Whole tensors of ``keys`` for one layer (or non-layered keys) from a dist checkpoint. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    request = {}
    for key in keys:
        md = metadata[key]
        if layer is None:
            data = torch.empty(tuple(md.global_shape), dtype=md.dtype)
            request[key] = ShardedTensor.from_rank_offsets(key, data, replica_id=0)
        else:
            data = torch.empty((1,) + tuple(md.global_shape[1:]), dtype=md.dtype)
            request[key] = ShardedTensor.from_rank_offsets(key, data, (0, layer, num_layers), replica_id=0)
    loaded = dist_checkpointing.load(request, dist_dir, validate_access_integrity=False)
    return {k: (loaded[k] if layer is None else loaded[k][0]) for k in keys}


def _check_checkpoint_tensors(metadata: dict, arch: ModelArch, ckpt: str) -> None:
    """Every model tensor the mapping needs, with its shape, and no model tensor it would drop."""
    expected = megatron_shapes(arch)
    for key, want in expected.items():
        if key not in metadata:
            raise ValueError(f"{ckpt}: tensor {key} is missing from the checkpoint")
        found = tuple(metadata[key].global_shape)
        if found != want:
            raise ValueError(f"{ckpt}: tensor {key} has shape {list(found)}, expected {list(want)} for {arch.model_type}")
    from megatron_prune.training.checkpoint import is_optimizer_key

    unmapped = sorted(k for k in metadata if k not in expected and not is_optimizer_key(k))
    if unmapped:
        raise ValueError(f"{ckpt}: model tensor(s) {', '.join(unmapped[:6])} have no HF counterpart; "
                         "refusing to drop them")


def export_steps(arch: ModelArch) -> list[tuple[list[TensorRule], int | None]]:
    """The order in which a streaming export reads a checkpoint, as ``(rules, layer)`` steps: the
    embedding, then per layer its slice of the layer-stacked keys and the layer's own keys (a MoE
    model keys its layers one by one; read whole, with ``None``), then the final norm and head.
    Every rule is in exactly one step (a layer-stacked one once per layer), so one step's tensors
    are all an export holds at a time."""
    rules = tensor_rules(arch)
    steps = [([r for r in rules if r.megatron_key == EMBED], None)]
    for layer in range(arch.num_layers):
        steps.append(([r for r in rules if r.layered], layer))
        steps.append(([r for r in rules if r.layer == layer], None))
    steps.append(([r for r in rules if r.stack is None and r.layer is None and r.megatron_key != EMBED], None))
    return [(step_rules, layer) for step_rules, layer in steps if step_rules]


def _iter_checkpoint_hf_tensors(dist_dir: str, *, metadata: dict, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors in checkpoint order, reading one layer (or the embedding, or the head) at a time."""
    for step_rules, layer in export_steps(arch):
        tensors = load_layer(dist_dir, metadata=metadata, keys=[r.megatron_key for r in step_rules], layer=layer,
                              num_layers=arch.num_layers)
        for rule in step_rules:
            tensor = tensors.pop(rule.megatron_key)
            if rule.stack == "expert":
                for expert in range(arch.num_experts):
                    yield from hf_tensors(rule, layer=expert, tensor=tensor[expert]).items()
            else:
                yield from hf_tensors(rule, layer=layer, tensor=tensor).items()


def _write_config(path: str, config: dict[str, Any]) -> None:
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def export_megatron_to_hf(
    *,
    load_dir: str,
    hf_out: str,
    dtype: str = "auto",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    hf_assets: str | None = None,
) -> list[str]:
    """Write the newest checkpoint under ``load_dir`` as an HF directory ``hf_out``; return its files.

    Streams one layer at a time from the dist checkpoint (saved at any layout). ``dtype`` ``auto``
    keeps the checkpoint's dtype. Collective when torch.distributed runs with several ranks (all
    read, rank 0 writes); the directory appears complete or not at all.
    """
    from megatron.core import dist_checkpointing

    from megatron_prune.training.checkpoint import read_meta

    check_output_dir(hf_out, flag="--hf-out")
    meta = read_meta(load_dir)
    ckpt = meta["path"]
    arch = ModelArch.from_dict(meta["arch"])
    dist_dir = os.path.join(ckpt, "dist")
    metadata = dist_checkpointing.load_tensors_metadata(dist_dir)
    _check_checkpoint_tensors(metadata, arch, ckpt)
    out_dtype = metadata[EMBED].dtype if dtype == "auto" else resolve_dtype(dtype, config={})
    return write_hf_directory(hf_out=hf_out, ckpt=ckpt, arch=arch, out_dtype=out_dtype, hf_assets=hf_assets,
                              max_shard_size=max_shard_size,
                              tensors=_iter_checkpoint_hf_tensors(dist_dir, metadata=metadata, arch=arch))


def check_output_dir(path: str, *, flag: str) -> None:
    """``path`` is an empty directory or can be created (with ``path + ".tmp"`` beside it, where
    the exporters write first); checked before any checkpoint is read."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"{flag} {path} exists and is not an empty directory")
    parent = os.path.dirname(os.path.abspath(path.rstrip("/") or path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} exists and is not a directory")
    try:  # probed by writing: permission bits alone let root pass where the filesystem refuses
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=parent))
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write into {parent}: {exc.strerror}") from None


@contextlib.contextmanager
def removed_on_failure(staging: str, *, writer: bool):
    """Run the writing of the ``staging`` directory; if it fails (a full disk, an interrupt), the
    writer removes what it wrote before the error goes on, so no partial copy is left behind."""
    try:
        yield
    except BaseException:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def write_hf_directory(*, hf_out: str, ckpt: str, arch: ModelArch, out_dtype: torch.dtype, hf_assets: str | None,
                       max_shard_size: str | int, tensors, what: str = "") -> list[str]:
    """Write HF-named ``tensors`` (an iterator every rank runs; rank 0 writes) with the config and
    assets of ``ckpt`` as the HF directory ``hf_out``, which appears complete or not at all."""
    import torch.distributed as dist

    from megatron_prune.training.parallel import barrier

    assets = find_hf_assets(ckpt, explicit=hf_assets)
    config = export_config(arch, assets=assets, dtype=out_dtype)
    plan = plan_shards(expected_hf_shapes(arch), dtype=out_dtype, max_shard_bytes=parse_size(max_shard_size))
    writer_rank = not dist.is_initialized() or dist.get_rank() == 0
    tmp = hf_out.rstrip("/") + ".tmp"
    if writer_rank:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    with removed_on_failure(tmp, writer=writer_rank):
        writer = ShardWriter(tmp, plan)
        for name, tensor in tensors:
            if writer_rank:
                writer.add(name, tensor.to(out_dtype))
        if writer_rank:
            files = writer.finish()
            _write_config(tmp, config)
            copied = copy_hf_assets(assets, tmp, skip=("config.json",)) if assets is not None else []
            if assets is None:
                logger.warning("%s: no %s found; wrote a config.json from the recorded architecture and no "
                               "tokenizer (pass --hf-assets to copy the original files)", ckpt, ASSETS_DIR)
            if os.path.isdir(hf_out):
                os.rmdir(hf_out)
            os.replace(tmp, hf_out)
            logger.info("exported %s%s to %s (%s; %s)", ckpt, what, hf_out, ", ".join(files),
                        ", ".join(copied) or "no assets")
    barrier()
    return sorted(os.listdir(hf_out))


# --- numerical comparison ----------------------------------------------------------------------


@dataclass(kw_only=True)
class LogitComparison:
    """How closely a model's logits follow the HF reference (over the true vocabulary)."""

    max_abs_diff: float
    """max |logits_HF - logits_Megatron| over every position and vocabulary entry."""
    mean_abs_diff: float
    """Mean |delta logits|."""
    kl_mean: float
    """Mean over positions of KL(softmax HF || softmax Megatron)."""
    top1_agreement: float
    """Fraction of positions whose argmax agrees."""
    top5_agreement: float
    """Mean overlap of the two top-5 sets, |top5_HF & top5_Megatron| / 5."""

    def ok(self, tolerance: float) -> bool:
        return bool(torch.isfinite(torch.tensor(self.max_abs_diff))) and self.max_abs_diff <= tolerance

    def summary(self) -> str:
        return (f"max |dlogits| {self.max_abs_diff:.3e}  mean |dlogits| {self.mean_abs_diff:.3e}  "
                f"KL(HF||Meg) {self.kl_mean:.3e}  top-1 {self.top1_agreement:.4f}  top-5 {self.top5_agreement:.4f}")


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> LogitComparison:
    """Compare ``[b, s, V]`` reference logits with candidate logits (padded columns beyond V dropped)."""
    vocab = reference.shape[-1]
    if candidate.shape[:-1] != reference.shape[:-1] or candidate.shape[-1] < vocab:
        raise ValueError(f"logits of shape {list(candidate.shape)} cannot be compared with {list(reference.shape)}")
    ref = reference.double()
    got = candidate[..., :vocab].double()
    diff = (ref - got).abs()
    log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top_ref, top_got = ref.topk(5, dim=-1).indices, got.topk(5, dim=-1).indices
    overlap = (top_ref.unsqueeze(-1) == top_got.unsqueeze(-2)).any(-1).double().sum(-1) / 5
    return LogitComparison(
        max_abs_diff=float(diff.max()),
        mean_abs_diff=float(diff.mean()),
        kl_mean=float(kl.mean()),
        top1_agreement=float((top_ref[..., 0] == top_got[..., 0]).double().mean()),
        top5_agreement=float(overlap.mean()),
    )


def _stash_logits(output_tensor: torch.Tensor):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(output_tensor)
    return output_tensor.new_zeros(()), {"logits": logits.detach()}


def _logits_forward_step(data_iterator, model):
    tokens = next(data_iterator)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, position_ids, None), _stash_logits


@torch.no_grad()
def megatron_logits(model: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """Full (padded) vocabulary logits ``[b, s, V_padded]`` of ``tokens``, fp32 on CPU, on every rank.

    Drives Megatron's forward-only pipeline schedule at the current layout, gathers the
    vocabulary over TP on the last stage and broadcasts along the pipeline. With virtual pipeline
    stages (several chunks) the interleaved schedule needs a multiple of PP microbatches: the rows
    run one per microbatch, the last row repeated to fill the count (its repeats are dropped).
    Sequence parallelism shards the sequence over TP: a length TP does not divide is padded with
    copies of the last token, whose positions (attention is causal) change no earlier logit and
    are dropped.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_prune.accelerator import get_accelerator
    from megatron_prune.training.step import run_schedule

    device = get_accelerator().device
    b, s = tokens.shape
    chunk = model[-1].module if hasattr(model[-1], "module") else model[-1]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if chunk.config.sequence_parallel and s % tp:
        tokens = torch.cat([tokens, tokens[:, -1:].expand(b, -s % tp)], dim=1)
    if len(model) > 1:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        microbatches = [tokens[i:i + 1] for i in range(b)]
        microbatches += [tokens[-1:]] * (-b % pp)
    else:
        microbatches = [tokens]
    data = [iter([mb.to(device) for mb in microbatches]) for _ in model]
    outputs = run_schedule(
        forward_step_func=_logits_forward_step,
        data_iterator=data if len(model) > 1 else data[0],
        model=model,
        num_microbatches=len(microbatches),
        seq_length=tokens.shape[1],
        micro_batch_size=microbatches[0].shape[0],
        forward_only=True,
    )
    vocab = chunk.vocab_size
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        logits = torch.cat([out["logits"] for out in outputs])[:b, :s].float().contiguous()
    else:
        logits = torch.empty(b, s, vocab, dtype=torch.float32, device=device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(logits, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return logits.cpu()


@torch.no_grad()
def hf_logits(hf_dir: str, tokens: torch.Tensor, *, device: str = "cpu") -> torch.Tensor:
    """fp32 logits ``[b, s, V]`` of ``tokens`` from ``transformers``' own model of ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.to(device).eval()
    return model(input_ids=tokens.to(device)).logits.float().cpu()


def comparison_tokens(*, vocab_size: int, batch_size: int, seq_length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_length), generator=gen)


def compare_hf_and_megatron(
    *,
    hf_dir: str,
    load_dir: str,
    parallel: ParallelConfig,
    seq_length: int = 32,
    batch_size: int = 2,
    seed: int = 0,
    hf_device: str = "cpu",
) -> LogitComparison:
    """Same tokens through the HF model and our checkpoint at ``parallel``. Collective; same result on every rank.

    The Megatron model is built in fp32 (a bf16 checkpoint is upcast on load) and the HF model is
    loaded in fp32, so both compute with identical weights.
    """
    from megatron_prune.model.provider import build_model_chunks
    from megatron_prune.training.checkpoint import load_checkpoint, read_arch, read_meta
    from megatron_prune.training.parallel import broadcast_object, model_parallel
    import torch.distributed as dist

    if read_meta(load_dir).get("lora"):
        raise ValueError(f"--load {load_dir} holds LoRA adapters, not a whole model; export it with "
                         "tools/convert_megatron_to_hf.py --load CKPT --hf-out DIR --merge-lora and compare DIR, or "
                         "compare its base checkpoint")
    arch = read_arch(load_dir)
    hf_arch = read_hf_arch(hf_dir)
    if hf_arch != arch:
        raise ValueError(f"--hf-dir {hf_dir} and --load {load_dir} describe different models: the HF config "
                         f"has {arch_difference(hf_arch.to_dict(), arch.to_dict())}, the checkpoint's values in "
                         "parentheses")
    if seq_length > arch.max_position_embeddings:
        raise ValueError(f"--seq-length {seq_length} exceeds max_position_embeddings {arch.max_position_embeddings}")
    tokens = comparison_tokens(vocab_size=arch.vocab_size, batch_size=batch_size, seq_length=seq_length, seed=seed)
    parallel = dataclasses.replace(parallel, bf16=False)
    with model_parallel(parallel):
        chunks = build_model_chunks(arch, parallel)
        for chunk in chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        load_checkpoint(load_dir, model=chunks, arch=arch)
        logits = megatron_logits(chunks, tokens)
    result = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = compare_logits(hf_logits(hf_dir, tokens, device=hf_device), logits)
    return broadcast_object(result)
