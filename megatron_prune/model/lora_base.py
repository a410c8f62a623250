"""The frozen base of a LoRA run: where it came from, recorded in checkpoints, and found again.

A LoRA training checkpoint holds the adapters, their optimizer state and the trainer state, not
the base weights. Its ``meta.json`` records the base under ``lora_base``::

    {"kind": "hf", "path": "/abs/Qwen3-4B", "arch": {...}, "fingerprint": "sha256:..."}
    {"kind": "preset", "name": "tiny", "seed": 1234, "arch": {...}}
    {"kind": "megatron", "path": "/abs/ckpt/iter_0000000", "arch": {...}, "fingerprint": "sha256:..."}

``--load`` rebuilds the base from that record (or, for an HF base, from ``--hf-model DIR``; for a
Megatron base, from ``--base-load DIR``), then loads the adapters; export does the same (or takes
``--base-hf DIR`` / ``--base-load DIR``). A base that is missing, of
another architecture, or with other weights (the fingerprint differs) is refused with one message.

A ``megatron`` base is one of our checkpoints without adapters (a converted model or a
full-parameter training checkpoint) given to ``--load`` when LoRA starts: only its model weights
are used, read at whatever layout the LoRA run has.

The fingerprint of an HF directory does not depend on where it lies or how it is sharded: it
hashes every tensor's name, dtype and shape and three short samples of its bytes (start,
middle, end), read straight from the safetensors files (a few hundred small reads). The fingerprint
of a Megatron checkpoint hashes its recorded architecture and iteration, the dist checkpoint's
metadata file and the same three samples of every data file: the files are written once and never
rewritten, so this is cheap, and it does not depend on the layout the checkpoint is later read at.

Importing this module imports no Megatron (it is used while validating flags).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable

from megatron_prune.model.arch import arch_difference

META_KEY = "lora_base"
"""The ``meta.json`` entry of a LoRA checkpoint that records its base."""
SAMPLE_BYTES = 256
"""Bytes hashed at each of the start, middle and end of every tensor for the fingerprint."""


@dataclass(frozen=True, kw_only=True)
class BaseSource:
    """Where the frozen base weights of a LoRA run come from."""

    kind: str
    """``hf`` (an HF model directory), ``preset`` (a named architecture initialised from a seed) or
    ``megatron`` (model weights of one of our checkpoints without adapters)."""
    arch: dict
    """The architecture (``ModelArch.to_dict()``) the base must have."""
    path: str | None = None
    """``hf``: absolute path of the HF directory; ``megatron``: of the checkpoint's iteration directory."""
    fingerprint: str | None = None
    """``hf``: :func:`hf_fingerprint` of the directory's weights; ``megatron``: :func:`megatron_fingerprint`."""
    name: str | None = None
    """``preset``: the preset name."""
    seed: int | None = None
    """``preset``: the seed its weights are initialised from."""

    def __post_init__(self) -> None:
        if self.kind not in ("hf", "preset", "megatron"):
            raise ValueError(f"unknown LoRA base kind {self.kind!r} (expected hf, preset or megatron)")

    def to_dict(self) -> dict[str, Any]:
        if self.kind in ("hf", "megatron"):
            return {"kind": self.kind, "path": self.path, "arch": self.arch, "fingerprint": self.fingerprint}
        return {"kind": "preset", "name": self.name, "seed": self.seed, "arch": self.arch}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BaseSource":
        return cls(**{k: data.get(k) for k in ("kind", "arch", "path", "fingerprint", "name", "seed")})

    def describe(self) -> str:
        if self.kind == "hf":
            return f"the HF model {self.path}"
        if self.kind == "megatron":
            return f"the Megatron checkpoint {self.path}"
        return f"the preset {self.name!r} (seed {self.seed})"


def _safetensors_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return sorted({os.path.join(hf_dir, v) for v in json.load(f).get("weight_map", {}).values()})
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def _samples(f, begin: int, end: int) -> bytes:
    """Bytes at the start, middle and end of the byte range [begin, end) of the open file ``f``."""
    out = b""
    for at in sorted({begin, max(begin, (begin + end) // 2 - SAMPLE_BYTES // 2), max(begin, end - SAMPLE_BYTES)}):
        f.seek(at)
        out += f.read(min(SAMPLE_BYTES, end - at))
    return out


def _range_digest(f, begin: int, end: int) -> bytes:
    """SHA-256 of every byte in [begin, end) of the open file ``f``, read in blocks."""
    digest = hashlib.sha256()
    f.seek(begin)
    left = end - begin
    while left > 0:
        block = f.read(min(1 << 24, left))
        if not block:
            break
        digest.update(block)
        left -= len(block)
    return digest.digest()


def megatron_fingerprint(ckpt: str, meta: dict, *, full: bool = False) -> str:
    """A cheap, location-independent fingerprint of the iteration directory ``ckpt`` (``meta``: its
    meta.json); ``full``: of every byte, not samples (slower; what a cache of its outputs needs)."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"arch": meta["arch"], "iteration": meta["iteration"]}, sort_keys=True).encode())
    dist_dir = os.path.join(ckpt, "dist")
    for name in sorted(os.listdir(dist_dir)):
        path = os.path.join(dist_dir, name)
        if not os.path.isfile(path) or not (name == ".metadata" or name.endswith(".distcp")):
            continue  # the tensors' index and data only
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            body = f.read() if name == ".metadata" else (_range_digest if full else _samples)(f, 0, size)
        digest.update(f"{name}|{size}|".encode())
        digest.update(body)
    return "sha256:" + digest.hexdigest()


def megatron_base(meta: dict) -> BaseSource:
    """The base record of a checkpoint without adapters (``meta``: :func:`read_meta` of it)."""
    ckpt = os.path.abspath(meta["path"])
    return BaseSource(kind="megatron", path=ckpt, arch=meta["arch"], fingerprint=megatron_fingerprint(ckpt, meta))


def hf_fingerprint(hf_dir: str, *, full: bool = False) -> str:
    """A cheap, location- and sharding-independent fingerprint of an HF directory's weights;
    ``full``: of every byte, not samples (slower; what a cache of its outputs needs)."""
    entries: list[tuple[str, str, list[int], bytes]] = []
    for path in _safetensors_files(hf_dir):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            data_start = 8 + header_len
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                samples = (_range_digest if full else _samples)(f, data_start + begin, data_start + end)
                entries.append((name, info["dtype"], list(info["shape"]), samples))
    digest = hashlib.sha256()
    for name, dtype, shape, samples in sorted(entries):
        digest.update(f"{name}|{dtype}|{shape}|".encode())
        digest.update(samples)
    return "sha256:" + digest.hexdigest()


def hf_base(hf_dir: str) -> BaseSource:
    """The base record of an HF directory (architecture read and checked, weights fingerprinted)."""
    from megatron_prune.model.arch import ModelArch

    return BaseSource(kind="hf", path=os.path.abspath(hf_dir), arch=ModelArch.from_hf_dir(hf_dir).to_dict(),
                      fingerprint=hf_fingerprint(hf_dir))


def preset_base(name: str, *, seed: int) -> BaseSource:
    from megatron_prune.model.arch import get_preset

    return BaseSource(kind="preset", name=name, seed=seed, arch=get_preset(name).to_dict())


def _arch_line(arch: dict) -> str:
    return f"{arch.get('model_type')}, {arch.get('num_layers')} layers, hidden {arch.get('hidden_size')}"


MEGATRON_FLAG = "--base-load"
"""The flag (trainers and export) that gives a moved Megatron base its new place."""


def resolve_base(record: dict | None, *, ckpt: str, override: str | None, flag: str,
                 preset: str | None = None, megatron_override: str | None = None) -> BaseSource:
    """The base recorded by the LoRA checkpoint ``ckpt``, found and checked.

    ``override`` (an HF directory given with ``flag``) replaces the recorded location of an HF base,
    ``megatron_override`` (a checkpoint given with ``--base-load``) that of a Megatron base; either
    must hold the same weights. Raises ValueError with a sentence naming the recorded base and the
    flag when the base is missing, of another architecture, or holds other weights.
    """
    if not record:
        raise ValueError(f"{ckpt} holds LoRA adapters but records no base model ({META_KEY} in meta.json); "
                         "it was saved by an older version that kept the base weights in the checkpoint")
    recorded = BaseSource.from_dict(record)
    if megatron_override and recorded.kind != "megatron":
        raise ValueError(f"{MEGATRON_FLAG}: the LoRA adapters of {ckpt} were trained on {recorded.describe()}, not on "
                         f"a Megatron checkpoint; drop {MEGATRON_FLAG}"
                         + (f" (a moved HF base is given with {flag} DIR)" if recorded.kind == "hf" else ""))
    if preset is not None and (recorded.kind != "preset" or recorded.name != preset):
        raise ValueError(f"{ckpt}: its adapters were trained on {recorded.describe()}, not on the preset "
                         f"{preset!r}; drop --model-preset to use the recorded base")
    if recorded.kind == "preset":
        if override is not None:
            raise ValueError(f"{flag} {override}: the LoRA adapters of {ckpt} were trained on {recorded.describe()}, "
                             f"which is rebuilt from its name and seed, not read from a directory; drop {flag}")
        return recorded
    if recorded.kind == "megatron":
        return _find_megatron(recorded, ckpt=ckpt, override=override, flag=flag, moved_to=megatron_override)
    where = override or recorded.path
    if not os.path.isfile(os.path.join(where, "config.json")):
        if override:
            raise ValueError(f"{flag} {override}: not an HF model directory (no config.json)")
        raise ValueError(f"{ckpt}: the base model its LoRA adapters were trained on, {recorded.path}, is missing "
                         f"(moved or deleted); pass the base model directory with {flag} DIR")
    found = _read_hf_base(where, ckpt=ckpt, override=override, flag=flag)
    source = f"{flag} {override}" if override else f"the recorded base {recorded.path}"
    if found.arch != recorded.arch:
        raise ValueError(f"{ckpt}: {source} is a different model ({_arch_line(found.arch)}: "
                         f"{arch_difference(found.arch, recorded.arch)}) than the base its LoRA adapters were trained "
                         f"on; pass the original base with {flag} DIR")
    if recorded.kind != "hf" or found.fingerprint != recorded.fingerprint:
        was = recorded.describe() if recorded.kind != "hf" else f"{recorded.path} (fingerprint {recorded.fingerprint})"
        raise ValueError(f"{ckpt}: {source} holds other weights (fingerprint {found.fingerprint}) than the base "
                         f"its LoRA adapters were trained on, {was}; pass the original base with {flag} DIR")
    return found


def _read_hf_base(where: str, *, ckpt: str, override: str | None, flag: str) -> BaseSource:
    """:func:`hf_base` of the base directory ``where``; its weight files missing is one sentence
    naming the directory and ``flag``."""
    try:
        return hf_base(where)
    except FileNotFoundError as exc:
        if override:
            raise ValueError(f"{flag} {override}: cannot read the base model's weights ({exc})") from None
        raise ValueError(f"{ckpt}: the base model its LoRA adapters were trained on, {where}, has lost its weights "
                         f"({exc}); pass the base model directory with {flag} DIR") from None


def _find_megatron(recorded: BaseSource, *, ckpt: str, override: str | None, flag: str,
                   moved_to: str | None) -> BaseSource:
    from megatron_prune.training.checkpoint import META, CheckpointError, read_meta

    if override:
        raise ValueError(f"{ckpt}: its LoRA adapters were trained on {recorded.describe()}; {flag} cannot replace "
                         f"a Megatron base: drop it (a moved Megatron base is given with {MEGATRON_FLAG} DIR)")
    if moved_to:
        if not os.path.isdir(moved_to):
            raise ValueError(f"{MEGATRON_FLAG} {moved_to}: directory does not exist")
        try:
            found = megatron_base(read_meta(moved_to))
        except (CheckpointError, OSError) as exc:
            raise ValueError(f"{MEGATRON_FLAG} {moved_to}: holds no complete Megatron checkpoint") from exc
        where, fix = f"{MEGATRON_FLAG} {moved_to}", f"pass the original base with {MEGATRON_FLAG} DIR"
    else:
        if not os.path.isfile(os.path.join(recorded.path, META)):
            raise ValueError(f"{ckpt}: the Megatron checkpoint its LoRA adapters were trained on, {recorded.path}, is "
                             f"missing (moved or deleted); pass its new place with {MEGATRON_FLAG} DIR, or put it "
                             "back at that path (a symbolic link to its new place will do)")
        found = megatron_base(read_meta(recorded.path))
        where, fix = f"the Megatron checkpoint at {recorded.path}", "put the original base back at that path"
    if found.arch != recorded.arch or found.fingerprint != recorded.fingerprint:
        raise ValueError(f"{ckpt}: {where} holds other weights "
                         f"({_arch_line(found.arch)}, fingerprint {found.fingerprint}) than the base its LoRA "
                         f"adapters were trained on ({_arch_line(recorded.arch)}, fingerprint "
                         f"{recorded.fingerprint}); {fix}")
    return found


def load_base_weights(chunks, source: BaseSource, *, arch) -> None:
    """Fill the base weights of unwrapped ``chunks`` (this rank's shards) from ``source``."""
    from megatron_prune.model.arch import ModelArch

    assert ModelArch.from_dict(source.arch) == arch, "the base was checked against the architecture"
    if source.kind == "preset":
        from megatron_prune.model.init import init_model_chunks

        init_model_chunks(chunks, seed=source.seed)
        return
    if source.kind == "megatron":
        from megatron_prune.training.checkpoint import load_model_weights

        load_model_weights(source.path, model=chunks, arch=arch)
        return
    from megatron_prune.model.hf_convert import fill_model_from_hf_dir

    fill_model_from_hf_dir(chunks, hf_dir=source.path, arch=arch)


def base_tensor_reader(source: BaseSource, *, arch) -> Callable[[str, int | None], Any]:
    """``read(megatron_key, layer)``: one whole base tensor (one layer of a layered key)."""
    from megatron_prune.model.hf_mapping import megatron_shapes, megatron_tensor, tensor_rules

    if source.kind == "preset":
        from megatron_prune.model.init import _global_init

        shapes = megatron_shapes(arch)

        def read_preset(key: str, layer: int | None):
            shape = shapes[key][1:] if layer is not None else shapes[key]
            return _global_init(key, tuple(shape), source.seed, () if layer is None else (layer,))

        return read_preset
    if source.kind == "megatron":
        return _megatron_reader(source.path, arch=arch)
    from megatron_prune.model.hf_convert import HFCheckpoint, hf_weights

    rules = {r.megatron_key: r for r in tensor_rules(arch)}
    hf = hf_weights(HFCheckpoint(source.path), arch)

    def read_hf(key: str, layer: int | None):
        return megatron_tensor(rules[key], layer=layer, hf=hf)

    return read_hf


def _megatron_reader(ckpt: str, *, arch) -> Callable[[str, int | None], Any]:
    """``read(megatron_key, layer)`` from a dist checkpoint, one layer's tensors loaded at a time."""
    from megatron.core import dist_checkpointing

    from megatron_prune.model.hf_convert import load_layer
    from megatron_prune.model.hf_mapping import tensor_rules

    dist_dir = os.path.join(ckpt, "dist")
    metadata = dist_checkpointing.load_tensors_metadata(dist_dir)
    rules = tensor_rules(arch)
    cache: dict[Any, dict] = {}

    def read(key: str, layer: int | None):
        if layer not in cache:
            cache.clear()
            keys = [r.megatron_key for r in rules if r.layered == (layer is not None)]
            cache[layer] = load_layer(dist_dir, metadata=metadata, keys=keys, layer=layer,
                                       num_layers=arch.num_layers)
        return cache[layer][key]

    return read
