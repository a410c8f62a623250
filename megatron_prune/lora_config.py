"""The LoRA flags (``--lora-*``) as a validated dataclass.

Kept apart from :mod:`megatron_prune.model.lora` so that parsing flags imports no Megatron
(on Ascend, MindSpeed must load before Megatron does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Linears LoRA can adapt: attention QKV and output projection, MLP fc1 (gate+up) and fc2."""


@dataclass(kw_only=True)
class LoRAConfig:
    """LoRA adapters (rank 0 = off: full-parameter training)."""

    rank: int = field(default=0, metadata={"flag": "--lora-rank"})
    """LoRA rank r of every adapter; 0 trains all weights (no adapters). With r > 0 only the adapters
    train and the DPO reference is the model with adapters off (no second copy)."""
    alpha: float | None = field(default=None, metadata={"flag": "--lora-alpha"})
    """LoRA alpha: adapter outputs are scaled by alpha / r (default: r, i.e. scale 1)."""
    dropout: float = field(default=0.0, metadata={"flag": "--lora-dropout"})
    """Dropout probability on the adapters' input (training passes and DPO branch pruning's pruned responses)."""
    targets: str = field(default=",".join(TARGETS), metadata={"flag": "--lora-targets"})
    """Comma-separated linears that get adapters (needs --lora-rank > 0): any of linear_qkv, linear_proj, linear_fc1, linear_fc2."""
    base_load: str | None = field(default=None, metadata={"flag": "--base-load"})
    """Resuming (--load) a LoRA checkpoint trained on a Megatron checkpoint that has since moved: the
    base checkpoint's new place (a save root or one iter_* directory). It must hold the same weights
    (the recorded fingerprint), and later checkpoints record the new place."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"--lora-rank must be an integer >= 0 (0 = off), got {self.rank!r}")
        if self.alpha is not None and not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"--lora-alpha must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        given = [flag for flag, on in (("--lora-alpha", self.alpha is not None), ("--lora-dropout", self.dropout != 0.0))
                 if on]
        if self.rank == 0 and given:
            raise ValueError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --lora-rank > 0 "
                             "(LoRA is off at rank 0)")
        names = self.target_names
        if not names:
            raise ValueError(f"--lora-targets names no linear; choose from {','.join(TARGETS)}")
        unknown = [n for n in names if n not in TARGETS]
        if unknown:
            raise ValueError(f"--lora-targets: unknown target(s) {','.join(unknown)}; choose from {','.join(TARGETS)}")
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-targets names a linear twice: {self.targets}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.targets.split(",") if n.strip())

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else float(self.rank)) / self.rank


def lora_active(lora: LoRAConfig | None) -> bool:
    """Whether ``lora`` asks for adapters (None and rank 0 both mean full-parameter training)."""
    return lora is not None and lora.enabled


def resolve_ref_mode(ref_mode: str | None, lora: LoRAConfig | None, *, ref_load: str | None = None) -> str:
    """The DPO reference mode to run: ``--ref-mode`` if given, else adapter-off under LoRA without
    ``--ref-load`` (online otherwise: a reference checkpoint was named). Raises ValueError for
    adapter-off without adapters or with --ref-load."""
    lora_on = lora_active(lora)
    mode = ref_mode or ("adapter-off" if lora_on and not ref_load else "online")
    if mode == "adapter-off" and not lora_on:
        raise ValueError("--ref-mode adapter-off needs LoRA adapters (--lora-rank > 0)")
    if mode == "adapter-off" and ref_load:
        raise ValueError("--ref-mode adapter-off uses the policy's own base weights as the reference; "
                         "--ref-load names another model: use --ref-mode online with it")
    return mode


def lora_meta(lora: LoRAConfig | None, *, base: dict | None = None) -> dict:
    """What a training checkpoint records about its adapters and (``base``) where its frozen base
    weights come from; empty without LoRA. A checkpoint with a recorded base holds no base weights."""
    if not lora_active(lora):
        return {}
    alpha = lora.alpha if lora.alpha is not None else float(lora.rank)  # as given: rank * scale can round
    meta = {"lora": {"rank": lora.rank, "alpha": alpha, "dropout": lora.dropout,
                     "targets": list(lora.target_names)}}
    if base is not None:
        from megatron_prune.model.lora_base import META_KEY

        meta[META_KEY] = base
    return meta


def check_load(load: str | None, lora: LoRAConfig | None, *, hf_model: str | None = None,
               model_preset: str | None = None, seed: int = 0) -> dict | None:
    """The base record of a LoRA run (None without LoRA), checked before any rank works.

    Starting: the base is ``hf_model`` (fingerprinted), ``model_preset``, or ``load`` when it holds
    no adapters (a converted model or a full-parameter training checkpoint: its model weights only).
    Resuming (``load`` is a LoRA checkpoint): the base it records, or ``hf_model`` in place of an HF
    base, or ``lora.base_load`` in place of a Megatron base; it must be found and hold the same weights. Raises ValueError for a missing or mismatched
    base and for other adapters than the flags ask for.
    """
    from megatron_prune.model.lora_base import META_KEY, hf_base, megatron_base, preset_base, resolve_base

    lora_on = lora_active(lora)
    base_load = lora.base_load if lora is not None else None
    if base_load and not lora_on:
        raise ValueError("--base-load names the base of a LoRA checkpoint; it needs --lora-rank > 0")
    if base_load and not load:
        raise ValueError("--base-load replaces the recorded base of a LoRA checkpoint given to --load; to start "
                         "LoRA from a Megatron checkpoint, give that checkpoint to --load")
    if not load:
        if not lora_on:
            return None
        if hf_model:
            return hf_base(hf_model).to_dict()
        return preset_base(model_preset, seed=seed).to_dict() if model_preset else None
    from megatron_prune.training.checkpoint import read_meta

    meta = read_meta(load)
    recorded = meta.get("lora")
    if recorded and not lora_on:
        raise ValueError(f"--load {load} holds LoRA adapters (rank {recorded['rank']}, targets "
                         f"{','.join(recorded['targets'])}); pass the same --lora-rank and --lora-targets to resume it")
    if recorded and (recorded["rank"] != lora.rank or set(recorded["targets"]) != set(lora.target_names)):
        raise ValueError(f"--load {load} holds LoRA adapters of rank {recorded['rank']} on "
                         f"{','.join(recorded['targets'])}, but the flags ask for rank {lora.rank} on {lora.targets}")
    if recorded:
        _take_recorded_alpha(load, recorded, lora)
    if not recorded and lora_on:
        if base_load:
            raise ValueError(f"--base-load: --load {load} holds no LoRA adapters, so it is itself the base LoRA "
                             "starts from; drop --base-load")
        if hf_model or model_preset:
            raise ValueError(f"--load {load} holds no LoRA adapters, so LoRA would start from it: give either "
                             f"--load (a Megatron base) or {'--hf-model' if hf_model else '--model-preset'}, not both")
        return megatron_base(meta).to_dict()
    if not lora_on:
        return None
    return resolve_base(meta.get(META_KEY), ckpt=meta["path"], override=hf_model, flag="--hf-model",
                        preset=model_preset, megatron_override=base_load).to_dict()


def _take_recorded_alpha(load: str, recorded: dict, lora: LoRAConfig) -> None:
    """The trained adapters' alpha / r is part of the model they make: without ``--lora-alpha``
    the run takes the checkpoint's (the default, alpha = r, would rescale them); another alpha
    is refused. ``lora`` is updated in place, so the run and its checkpoints use the recorded one."""
    trained = float(recorded.get("alpha", recorded["rank"]))
    if lora.alpha is None:
        lora.alpha = trained
    elif not math.isclose(lora.alpha, trained, rel_tol=1e-9):
        raise ValueError(f"--lora-alpha {lora.alpha:g}: --load {load} holds adapters trained at --lora-alpha "
                         f"{trained:g} (scale {trained / lora.rank:g}), and another alpha would rescale them; "
                         f"leave --lora-alpha out (the checkpoint's is used) or pass --lora-alpha {trained:g}")
