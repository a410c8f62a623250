"""HF-style architecture description of a decoder-only model, and named tiny presets.

One :class:`ModelArch` describes Llama, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (qk-norm) and
Qwen3-MoE (top-k routed experts, no shared experts) models. It is read from an HF ``config.json``, recorded in our checkpoints, and turned into a
Megatron ``TransformerConfig`` by :mod:`megatron_prune.model.provider`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


@dataclass(kw_only=True)
class ModelArch:
    """Architecture of a decoder-only transformer (RMSNorm, SwiGLU, RoPE, GQA)."""

    model_type: str = "llama"
    """HF ``model_type``: llama, mistral, qwen2, qwen3 or qwen3_moe."""
    vocab_size: int
    """True vocabulary size (Megatron pads the embedding beyond it; padding is never scored)."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU inner width (of the dense MLP layers of a MoE model)."""
    num_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA groups)."""
    head_dim: int | None = None
    """Per-head width; defaults to hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """HF rope scaling dict; only Llama-3 style scaling (Megatron's low/high/original constants) is supported."""
    max_position_embeddings: int = 4096
    """Longest sequence the RoPE tables are built for."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on per-head queries and keys (Qwen3)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int | None = None
    """SwiGLU inner width of one expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to one (softmax over the chosen experts)."""
    decoder_sparse_step: int = 1
    """Layer i (0-based) is a MoE layer when (i + 1) is a multiple of this and i is not in mlp_only_layers."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """0-based layers that keep a dense MLP in a MoE model."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if float(self.rope_theta) != int(self.rope_theta):
            raise ValueError(f"rope_theta {self.rope_theta} is not an integer; Megatron-Core takes an integer rotary base")
        self._check_moe()
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be divisible by num_attention_heads when head_dim is not set")
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer_pattern(self) -> list[int]:
        """Per layer (0-based): 1 for a MoE layer, 0 for a dense MLP (Megatron's moe_layer_freq list)."""
        if not self.is_moe:
            return [0] * self.num_layers
        only = set(self.mlp_only_layers)
        return [int(i not in only and (i + 1) % self.decoder_sparse_step == 0) for i in range(self.num_layers)]

    def _check_moe(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if not self.is_moe:
            return
        if self.model_type != "qwen3_moe":
            raise ValueError(f"num_experts > 0 needs model_type 'qwen3_moe', got {self.model_type!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
            )
        if self.num_experts_per_tok == 1 and self.norm_topk_prob:
            raise ValueError("num_experts_per_tok 1 with norm_topk_prob true (each token's one expert weighted 1) is "
                             "not supported: Megatron's top-1 router weights the expert by its softmax probability; "
                             "models with norm_topk_prob false, or top-k above 1, are")
        if not self.moe_intermediate_size or self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        self.mlp_only_layers = sorted(int(i) for i in self.mlp_only_layers)
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are outside 0..{self.num_layers - 1}")
        if not any(self.moe_layer_pattern()):
            raise ValueError("num_experts > 0 but decoder_sparse_step and mlp_only_layers leave no MoE layer")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelArch":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown architecture fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, source: str = "config.json") -> "ModelArch":
        """Read an HF ``config.json`` dict; refuse what cannot be represented, naming the field."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {config['hidden_act']!r} is not supported (only silu/SwiGLU)")
        if model_type != "qwen3_moe" and (config.get("num_experts") or config.get("num_local_experts")):
            raise ValueError(
                f"{source}: mixture-of-experts models are supported as model_type qwen3_moe only, got {model_type!r}"
            )
        moe = _moe_fields(config, source) if model_type == "qwen3_moe" else {}
        if model_type == "mistral":
            _check_mistral_window(config, source)
        if config.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        max_positions = _int_field(config, "max_position_embeddings", source,
                                   default=_DEFAULT_MAX_POSITIONS[model_type])
        rope_theta, rope_scaling = _rope_fields(config, source, max_positions=max_positions)
        # transformers' Qwen2 always has q/k/v biases and Mistral never (neither reads attention_bias)
        qkv_bias = model_type == "qwen2" or (model_type != "mistral" and bool(config.get("attention_bias", False)))
        sizes = {name: _int_field(config, key, source) for name, key in _REQUIRED_SIZES.items()}
        absent = _ABSENT_SIZE_DEFAULTS.get(model_type, {})
        kv_default = sizes["num_attention_heads"] if "num_key_value_heads" in config else absent.get(
            "num_key_value_heads", sizes["num_attention_heads"])
        sizes.update(num_key_value_heads=_int_field(config, "num_key_value_heads", source, default=kv_default),
                     head_dim=_int_field(config, "head_dim", source,
                                         default=None if "head_dim" in config else absent.get("head_dim")),
                     max_position_embeddings=max_positions)
        try:
            return cls(
                model_type=model_type,
                **sizes,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                **moe,
            )
        except (TypeError, ValueError) as exc:  # the dataclass's own checks do not know the file
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelArch":
        cfg_path = os.path.join(path, "config.json")
        return cls.from_hf_config(read_hf_config_file(cfg_path, flag="--hf-model"), source=cfg_path)


def read_hf_config_file(path: str, *, flag: str) -> dict[str, Any]:
    """The JSON object of an HF ``config.json``; FileNotFoundError or ValueError naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {flag} must be an HF model directory")
    with open(path, "rb") as f:
        try:
            config = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


# ModelArch field -> the HF config.json field every supported model type must set.
_REQUIRED_SIZES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                   "num_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads"}
_MISSING = object()


def _int_field(config: dict[str, Any], key: str, source: str, *, default: Any = _MISSING) -> Any:
    """An integer field of an HF config (``default`` when absent or null; required without one)."""
    value = config.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{source}: missing field {key!r} (an integer)")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    return value


# transformers' defaults for a Mistral config that leaves these fields out.
_MISTRAL_DEFAULT_WINDOW = 4096
_MISTRAL_DEFAULT_MAX_POSITIONS = 131072


def _check_mistral_window(config: dict[str, Any], source: str) -> None:
    """Mistral attends within ``sliding_window`` tokens (transformers' default 4096 when the field
    is absent); Megatron's model here attends to the whole context, which is the same model only
    when the window covers every position."""
    window = _int_field(config, "sliding_window", source, default=None if "sliding_window" in config
                        else _MISTRAL_DEFAULT_WINDOW)
    if window in (None, 0):
        return
    max_pos = _int_field(config, "max_position_embeddings", source, default=_MISTRAL_DEFAULT_MAX_POSITIONS)
    if window < max_pos:
        shown = window if "sliding_window" in config else f"{window} (transformers' default when the field is absent)"
        raise ValueError(f"{source}: sliding_window={shown} is not supported; set it to null for full attention")


# Fields of an HF MoE config that change the model and that Megatron's layer here cannot express.
_UNSUPPORTED_MOE_FIELDS = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
    "moe_shared_expert_intermediate_size": "shared experts",
    "n_group": "group-limited routing",
    "topk_group": "group-limited routing",
    "first_k_dense_replace": "dense-first layers given as first_k_dense_replace",
}


def _moe_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    for key, what in _UNSUPPORTED_MOE_FIELDS.items():
        if config.get(key):
            raise ValueError(f"{source}: {key}={config[key]!r} ({what}) is not supported for MoE models")
    # transformers 5 writes the expert count as num_local_experts, earlier releases as num_experts.
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if not num_experts:
        raise ValueError(f"{source}: a qwen3_moe config needs num_experts > 0")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if config.get(key) in (None, 0):
            raise ValueError(f"{source}: a qwen3_moe config needs {key}")
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=int(config.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=list(config.get("mlp_only_layers") or []),
    )


_ROPE_SCALING_KEYS = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings")

# Megatron implements Llama-3.1 scaling with a free factor and fixed low/high/original constants.
_MEGATRON_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}


# transformers' defaults for a config that leaves max_position_embeddings out.
# What transformers' config classes take for a field config.json leaves out (not one set to null):
# the class's default argument. Reading the same sizes as transformers makes a config that relies on
# them convert to the model transformers builds (a different reading fails on the weights' shapes,
# naming a tensor instead of the field). Without an entry: as many key-value heads as attention
# heads, head_dim = hidden_size / num_attention_heads.
_ABSENT_SIZE_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32},
    "qwen3_moe": {"num_key_value_heads": 4},
    "qwen2": {"num_key_value_heads": 32},
    "mistral": {"num_key_value_heads": 8},
}

_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": _MISTRAL_DEFAULT_MAX_POSITIONS, "qwen2": 32768, "qwen3": 32768,
                          "qwen3_moe": 32768}


def _rope_fields(config: dict[str, Any], source: str, *, max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` as transformers reads them: the rope dict is ``rope_scaling`` (older
    configs) or ``rope_parameters`` (transformers 5, which holds theta too), its type ``rope_type`` or
    the legacy ``type``; no scaling (None) for the default type. A scaling Megatron-Core cannot build
    is refused, as is a theta given twice with two values."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope_scaling must be an object, got {rope!r}")
    parameters = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta, inner = config.get("rope_theta"), parameters.get("rope_theta")
    if theta is not None and inner is not None and float(theta) != float(inner):
        raise ValueError(f"{source}: rope_theta={theta} and rope_parameters.rope_theta={inner} differ; keep one")
    theta = float(inner if inner is not None else theta if theta is not None else 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported by Megatron-Core (only llama3)")
    scaling = {k: v for k, v in rope.items() if k in _ROPE_SCALING_KEYS}
    # transformers: a top-level original_max_position_embeddings wins, then the dict's, then the context
    if config.get("original_max_position_embeddings"):
        original = ("original_max_position_embeddings", config["original_max_position_embeddings"])
    elif rope.get("original_max_position_embeddings"):
        original = ("rope_scaling.original_max_position_embeddings", rope["original_max_position_embeddings"])
    else:
        original = ("max_position_embeddings (the original context where rope_scaling names none)", max_positions)
    checked = [(f"rope_scaling.{key}", scaling.get(key, _MEGATRON_LLAMA3_SCALING[key]))
               for key in ("low_freq_factor", "high_freq_factor")] + [original]
    for (name, value), expected in zip(checked, _MEGATRON_LLAMA3_SCALING.values()):
        if float(value) != expected:
            raise ValueError(f"{source}: {name}={value} is not supported; Megatron-Core's llama3 scaling is fixed at "
                             f"{expected}")
    return theta, scaling


PRESETS: dict[str, ModelArch] = {
    # A few hundred thousand parameters: unit tests and parity checks.
    "tiny": ModelArch(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        qk_norm=True,
    ),
}
# Same shape with tied embeddings, for the tied-weight paths under PP.
PRESETS["tiny-tied"] = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
# Qwen3-MoE shape: 4 experts, top-2, layer 0 dense (a per-layer mix of dense MLP and MoE).
PRESETS["tiny-moe"] = dataclasses.replace(
    PRESETS["tiny"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
)


def get_preset(name: str) -> ModelArch:
    if name not in PRESETS:
        raise ValueError(f"--model-preset {name!r} is unknown; choose from {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


def arch_difference(found: dict[str, Any], wanted: dict[str, Any], *, limit: int = 4) -> str:
    """The fields in which two architectures (``ModelArch.to_dict()``) differ, as
    ``"hidden_size 64 (not 128), ..."``: what a "different architecture" refusal shows."""
    keys = [k for k in sorted(set(found) | set(wanted)) if found.get(k) != wanted.get(k)]
    shown = ", ".join(f"{k} {found.get(k)!r} (not {wanted.get(k)!r})" for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
