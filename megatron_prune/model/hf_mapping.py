"""Tensor-by-tensor mapping between HF Llama-family weights and our Megatron checkpoint tensors.

Pure tensor code: no Megatron, no files. One :class:`TensorRule` per Megatron checkpoint key says
which HF tensors make it and how (per layer for ``decoder.layers.*`` keys, which carry a leading
layer axis in the checkpoint). Covered: Llama, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (qk-norm),
tied or untied embeddings.

Layouts (``H`` query heads, ``G`` key/value groups, ``d`` head dim, ``h`` hidden, ``F`` ffn):

- QKV: HF ``q_proj [H*d, h]``, ``k_proj [G*d, h]``, ``v_proj [G*d, h]``; Megatron's fused
  ``linear_qkv`` holds per query group ``[q of the group's H/G heads, k_g, v_g]``. Biases alike.
- MLP: Megatron ``linear_fc1 = cat([gate_proj, up_proj])``, ``linear_fc2 = down_proj``.
- Norms: ``input_layernorm`` is stored as ``linear_qkv.layer_norm_weight``,
  ``post_attention_layernorm`` as ``linear_fc1.layer_norm_weight`` (the keys Megatron uses for both
  the local and the Transformer-Engine layer specs).
- Embedding / output layer: padded with zero rows to :func:`padded_vocab_size`; padding is
  stripped on the way back.
- Qwen3-MoE: Megatron keys its layers one by one (``decoder.layers.{i}.*``, no layer axis) when
  dense-MLP and MoE layers mix. A MoE layer's router ``mlp.router.weight = mlp.gate.weight``
  ``[E, h]``; its experts are stacked on a leading expert axis,
  ``mlp.experts.experts.linear_fc1[e] = cat([experts.{e}.gate_proj, experts.{e}.up_proj])`` and
  ``linear_fc2[e] = experts.{e}.down_proj``. The fused HF expert layout
  (``experts.gate_up_proj [E, 2I, h]``, ``experts.down_proj [E, h, I]``) is read as well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping

import torch

from megatron_prune.model.arch import ModelArch

logger = logging.getLogger(__name__)

# The embedding is padded to a multiple of this, independent of TP, so that one checkpoint
# reshards to TP = 1, 2, 4, 8 (Megatron's default pads to 128 x TP, which changes with TP). This
# module stays free of Megatron; the model provider takes the value from here.
VOCAB_PAD_MULTIPLE = 1024

HF_EMBED = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"
HF_LAYER = "model.layers.{layer}."

EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
INPUT_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
Q_NORM = "decoder.layers.self_attention.q_layernorm.weight"
K_NORM = "decoder.layers.self_attention.k_layernorm.weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
PRE_MLP_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"

# HF tensors that are buffers, not weights (older checkpoints saved the RoPE table).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
ROUTER = "mlp.router.weight"
EXPERT_FC1 = "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.experts.linear_fc2.weight"


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class TensorRule:
    """How one Megatron checkpoint key is made from HF tensors, and back."""

    megatron_key: str
    """Megatron checkpoint key (``decoder.layers.*`` keys are stacked over layers unless ``stack`` says otherwise)."""
    hf_names: tuple[str, ...]
    """HF tensor names; ``{layer}`` / ``{expert}`` is replaced by the index along ``stack``."""
    hf_shapes: tuple[tuple[int, ...], ...]
    """Expected shape of each HF tensor, in the order of ``hf_names``."""
    shape: tuple[int, ...]
    """Megatron shape of one layer's tensor (the whole tensor for non-layered keys)."""
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    """HF tensors (in ``hf_names`` order) -> the Megatron tensor."""
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    """The Megatron tensor -> HF tensors (in ``hf_names`` order)."""
    stack: str | None = None
    """The leading axis the checkpoint stacks this key over: "layer", "expert" or None."""
    layer: int | None = None
    """The layer of a per-layer key (Megatron keys the layers of a MoE model one by one)."""

    @property
    def layered(self) -> bool:
        return self.stack == "layer"

    def names(self, layer: int | None) -> tuple[str, ...]:
        """HF names at index ``layer`` along :attr:`stack` (a layer, or an expert)."""
        if self.stack is not None:
            assert layer is not None, f"{self.megatron_key} needs a {self.stack} index"
            return tuple(n.format(**{self.stack: layer}) for n in self.hf_names)
        return self.hf_names


# --- layout transforms -------------------------------------------------------------------------


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, arch: ModelArch) -> torch.Tensor:
    """HF q/k/v (weights [n*d, h] or biases [n*d]) -> Megatron's per-group interleaved QKV."""
    groups, d = arch.num_key_value_heads, arch.head_dim
    per_group = arch.num_attention_heads // groups
    rest = tuple(q.shape[1:])
    parts = [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
    return torch.cat(parts, dim=1).reshape(groups * (per_group + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, *, arch: ModelArch) -> list[torch.Tensor]:
    """Inverse of :func:`interleave_qkv`."""
    groups, d = arch.num_key_value_heads, arch.head_dim
    per_group = arch.num_attention_heads // groups
    rest = tuple(qkv.shape[1:])
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return [t.reshape(-1, *rest).clone() for t in (q, k, v)]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Append zero rows up to ``rows`` (the padded vocabulary)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def strip_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t[:rows].clone()


def _identity(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _as_list(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    return [half.clone() for half in t.chunk(2, dim=0)]


# --- rules -------------------------------------------------------------------------------------


def tensor_rules(arch: ModelArch) -> list[TensorRule]:
    """Every Megatron checkpoint key of ``arch`` with its HF source tensors."""
    h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q_rows, kv_rows = arch.num_attention_heads * d, arch.num_key_value_heads * d
    v, vp = arch.vocab_size, padded_vocab_size(arch.vocab_size)
    layer = HF_LAYER
    attn = layer + "self_attn."

    def qkv_in(ts: list[torch.Tensor]) -> torch.Tensor:
        return interleave_qkv(*ts, arch=arch)

    def qkv_out(t: torch.Tensor) -> list[torch.Tensor]:
        return split_qkv(t, arch=arch)

    def vocab_in(ts: list[torch.Tensor]) -> torch.Tensor:
        return pad_rows(ts[0], vp)

    def vocab_out(t: torch.Tensor) -> list[torch.Tensor]:
        return [strip_rows(t, v)]

    def rule(key, names, hf_shapes, shape, to_megatron=_identity, to_hf=_as_list) -> TensorRule:
        return TensorRule(megatron_key=key, hf_names=tuple(names), hf_shapes=tuple(hf_shapes), shape=shape,
                          to_megatron=to_megatron, to_hf=to_hf,
                          stack="layer" if key.startswith("decoder.layers.") else None)

    rules = [
        rule(EMBED, [HF_EMBED], [(v, h)], (vp, h), vocab_in, vocab_out),
        rule(INPUT_NORM, [layer + "input_layernorm.weight"], [(h,)], (h,)),
        rule(QKV, [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
             [(q_rows, h), (kv_rows, h), (kv_rows, h)], (q_rows + 2 * kv_rows, h), qkv_in, qkv_out),
    ]
    if arch.qkv_bias:
        rules.append(rule(QKV_BIAS, [attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"],
                          [(q_rows,), (kv_rows,), (kv_rows,)], (q_rows + 2 * kv_rows,), qkv_in, qkv_out))
    if arch.qk_norm:
        rules.append(rule(Q_NORM, [attn + "q_norm.weight"], [(d,)], (d,)))
        rules.append(rule(K_NORM, [attn + "k_norm.weight"], [(d,)], (d,)))
    rules += [
        rule(PROJ, [attn + "o_proj.weight"], [(h, q_rows)], (h, q_rows)),
        rule(PRE_MLP_NORM, [layer + "post_attention_layernorm.weight"], [(h,)], (h,)),
        rule(FC1, [layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"], [(f, h), (f, h)], (2 * f, h),
             _cat_rows, _halves),
        rule(FC2, [layer + "mlp.down_proj.weight"], [(h, f)], (h, f)),
        rule(FINAL_NORM, [HF_FINAL_NORM], [(h,)], (h,)),
    ]
    if not arch.tie_word_embeddings:
        rules.append(rule(OUTPUT, [HF_LM_HEAD], [(v, h)], (vp, h), vocab_in, vocab_out))
    return _per_layer_moe_rules(rules, arch) if arch.is_moe else rules


def _per_layer_moe_rules(rules: list[TensorRule], arch: ModelArch) -> list[TensorRule]:
    """A MoE model's rules: every layered rule split into one rule per layer, and a MoE layer's
    dense MLP rules replaced by its router and its expert-stacked MLP."""
    h, i_e, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
    out: list[TensorRule] = []
    for layer, sparse in enumerate(arch.moe_layer_pattern()):
        prefix = f"decoder.layers.{layer}."
        hf_layer = HF_LAYER.format(layer=layer)
        for r in rules:
            if not r.layered or (sparse and r.megatron_key in (FC1, FC2)):
                continue
            out.append(replace(r, megatron_key=prefix + r.megatron_key[len("decoder.layers."):],
                               hf_names=tuple(n.format(layer=layer) for n in r.hf_names), stack=None, layer=layer))
        if not sparse:
            continue
        expert = hf_layer + "mlp.experts.{expert}."
        out += [
            TensorRule(megatron_key=prefix + ROUTER, hf_names=(hf_layer + "mlp.gate.weight",), hf_shapes=((e, h),),
                       shape=(e, h), to_megatron=_identity, to_hf=_as_list, layer=layer),
            TensorRule(megatron_key=prefix + EXPERT_FC1,
                       hf_names=(expert + "gate_proj.weight", expert + "up_proj.weight"),
                       hf_shapes=((i_e, h), (i_e, h)), shape=(2 * i_e, h), to_megatron=_cat_rows, to_hf=_halves,
                       stack="expert", layer=layer),
            TensorRule(megatron_key=prefix + EXPERT_FC2, hf_names=(expert + "down_proj.weight",),
                       hf_shapes=((h, i_e),), shape=(h, i_e), to_megatron=_identity, to_hf=_as_list,
                       stack="expert", layer=layer),
        ]
    return [r for r in rules if r.stack is None and r.megatron_key == EMBED] + out + [
        r for r in rules if r.stack is None and r.megatron_key != EMBED
    ]


def layer_indices(rule: TensorRule, arch: ModelArch) -> list[int | None]:
    """The indices along the rule's stacked axis (layers or experts), or [None]."""
    if rule.stack is None:
        return [None]
    return list(range(arch.num_layers if rule.stack == "layer" else arch.num_experts))


def megatron_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Whole Megatron tensor shapes (stacked keys with their leading layer or expert axis)."""
    return {r.megatron_key: (() if r.stack is None else (len(layer_indices(r, arch)),)) + r.shape
            for r in tensor_rules(arch)}


def expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor ``arch`` needs, in checkpoint order (embedding, layers, norm, head)."""
    out: dict[str, tuple[int, ...]] = {}
    rules = tensor_rules(arch)
    for r in rules:
        if r.megatron_key == EMBED:
            out.update(zip(r.names(None), r.hf_shapes))
    for layer in range(arch.num_layers):
        for r in rules:
            if r.layered:
                out.update(zip(r.names(layer), r.hf_shapes))
            elif r.layer == layer:
                for index in layer_indices(r, arch):
                    out.update(zip(r.names(index), r.hf_shapes))
    for r in rules:
        if r.stack is None and r.layer is None and r.megatron_key != EMBED:
            out.update(zip(r.names(None), r.hf_shapes))
    return out


# --- validation --------------------------------------------------------------------------------


def _listing(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_hf_tensors(shapes: Mapping[str, tuple[int, ...]], arch: ModelArch, *, source: str) -> None:
    """Refuse missing tensors, tensors the architecture does not use, and wrong shapes, by name."""
    expected = expected_hf_shapes(arch)
    present = {name for name in shapes if not name.endswith(_IGNORED_HF_SUFFIXES)}
    missing = [n for n in expected if n not in present]
    if missing:
        raise ValueError(
            f"{source}: missing tensor(s) {_listing(missing)} needed by this {arch.model_type} config "
            f"({arch.num_layers} layers, tie_word_embeddings={arch.tie_word_embeddings}, "
            f"qkv_bias={arch.qkv_bias}, qk_norm={arch.qk_norm})"
        )
    allowed_extra = {HF_LM_HEAD} if arch.tie_word_embeddings else set()
    unexpected = sorted(present - set(expected) - allowed_extra)
    if unexpected:
        raise ValueError(
            f"{source}: unexpected tensor(s) {_listing(unexpected)}: config.json does not describe them "
            "(e.g. an attention output or MLP bias, more layers than num_hidden_layers); refusing to drop weights"
        )
    for name, want in expected.items():
        found = tuple(shapes[name])
        if found != want:
            raise ValueError(f"{source}: tensor {name} has shape {list(found)}, expected {list(want)} from config.json")
    if HF_LM_HEAD in present and arch.tie_word_embeddings and tuple(shapes[HF_LM_HEAD]) != expected[HF_EMBED]:
        raise ValueError(
            f"{source}: tensor {HF_LM_HEAD} has shape {list(shapes[HF_LM_HEAD])}, expected "
            f"{list(expected[HF_EMBED])} (tied to {HF_EMBED})"
        )


def check_tied_lm_head(hf: Mapping[str, torch.Tensor], arch: ModelArch, *, source: str) -> None:
    """A tied checkpoint may still store ``lm_head.weight``; it must equal the embedding."""
    if arch.tie_word_embeddings and HF_LM_HEAD in hf:
        if not torch.equal(hf[HF_LM_HEAD], hf[HF_EMBED]):
            raise ValueError(
                f"{source}: tie_word_embeddings=true but {HF_LM_HEAD} differs from {HF_EMBED}; "
                "the output layer would be silently replaced by the embedding"
            )
        logger.info("%s: %s equals %s (tied); not converted separately", source, HF_LM_HEAD, HF_EMBED)


def _check_megatron_state(whole: Mapping[str, torch.Tensor], arch: ModelArch) -> None:
    expected = megatron_shapes(arch)
    missing = [k for k in expected if k not in whole]
    if missing:
        raise ValueError(f"Megatron state is missing {_listing(missing)} for this {arch.model_type} architecture")
    unexpected = sorted(set(whole) - set(expected))
    if unexpected:
        raise ValueError(f"Megatron state has tensor(s) {_listing(unexpected)} that no HF tensor maps to")
    for key, want in expected.items():
        if tuple(whole[key].shape) != want:
            raise ValueError(f"Megatron tensor {key} has shape {list(whole[key].shape)}, expected {list(want)}")


# --- conversion of one tensor / a whole state --------------------------------------------------


def megatron_tensor(rule: TensorRule, *, layer: int | None, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The Megatron tensor of ``rule`` (one layer of it, for layered keys) from HF tensors."""
    sources = []
    for name, want in zip(rule.names(layer), rule.hf_shapes):
        if name not in hf:
            raise ValueError(f"missing HF tensor {name} (needed for {rule.megatron_key})")
        t = hf[name]
        if tuple(t.shape) != want:
            raise ValueError(f"HF tensor {name} has shape {list(t.shape)}, expected {list(want)}")
        sources.append(t)
    return rule.to_megatron(sources)


def hf_tensors(rule: TensorRule, *, layer: int | None, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF tensors of ``rule`` from its Megatron tensor (one layer of it, for layered keys)."""
    if tuple(tensor.shape) != rule.shape:
        where = f" layer {layer}" if layer is not None else ""
        raise ValueError(f"Megatron tensor {rule.megatron_key}{where} has shape {list(tensor.shape)}, "
                         f"expected {list(rule.shape)}")
    return dict(zip(rule.names(layer), rule.to_hf(tensor)))


class PerExpertView(Mapping):
    """A lazy view of HF tensors in which the fused expert layout of newer transformers releases
    (``mlp.experts.gate_up_proj [E, 2I, h]``, ``mlp.experts.down_proj [E, h, I]``) reads as the
    per-expert tensors (``mlp.experts.{e}.gate_proj.weight`` ...); other names pass through."""

    _FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")

    def __init__(self, hf: Mapping[str, torch.Tensor], arch: ModelArch) -> None:
        self._hf = hf
        self._arch = arch
        self._virtual: dict[str, tuple[str, int, int]] = {}  # per-expert name -> (fused name, expert, part)
        for name in list(hf.shapes() if hasattr(hf, "shapes") else hf.keys()):
            for suffix in self._FUSED:
                if name.endswith(suffix):
                    base = name[: -len(suffix)] + ".mlp.experts."
                    for e in range(arch.num_experts):
                        if suffix.endswith("gate_up_proj"):
                            self._virtual[f"{base}{e}.gate_proj.weight"] = (name, e, 0)
                            self._virtual[f"{base}{e}.up_proj.weight"] = (name, e, 1)
                        else:
                            self._virtual[f"{base}{e}.down_proj.weight"] = (name, e, -1)

    @property
    def fused(self) -> bool:
        return bool(self._virtual)

    def _names(self) -> list[str]:
        fused = {v[0] for v in self._virtual.values()}
        return [n for n in self._hf if n not in fused] + list(self._virtual)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._virtual:
            return self._hf[name]
        fused, e, part = self._virtual[name]
        t = self._hf[fused][e]
        if part < 0:
            return t
        return t.chunk(2, dim=0)[part]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._virtual or name in self._hf

    def shapes(self) -> dict[str, tuple[int, ...]]:
        base = self._hf.shapes() if hasattr(self._hf, "shapes") else {k: tuple(v.shape) for k, v in self._hf.items()}
        fused = {v[0] for v in self._virtual.values()}
        out = {k: v for k, v in base.items() if k not in fused}
        for name, (src, _, part) in self._virtual.items():
            shape = base[src][1:]
            out[name] = shape if part < 0 else (shape[0] // 2,) + tuple(shape[1:])
        return out


def hf_to_megatron_state(hf: Mapping[str, torch.Tensor], arch: ModelArch, *, source: str = "HF state") -> dict[str, torch.Tensor]:
    """Whole Megatron tensors (layered keys stacked on a leading layer axis) from an HF state dict.

    ``hf`` may be lazy (any Mapping; :class:`megatron_prune.model.hf_convert.HFCheckpoint` reads on
    access). Dtypes are preserved.
    """
    if arch.is_moe:
        hf = PerExpertView(hf, arch)
    shapes = hf.shapes() if hasattr(hf, "shapes") else {k: tuple(v.shape) for k, v in hf.items()}
    check_hf_tensors(shapes, arch, source=source)
    check_tied_lm_head(hf, arch, source=source)
    out: dict[str, torch.Tensor] = {}
    for rule in tensor_rules(arch):
        parts = [megatron_tensor(rule, layer=layer, hf=hf) for layer in layer_indices(rule, arch)]
        out[rule.megatron_key] = torch.stack(parts) if rule.stack is not None else parts[0]
    return out


def megatron_to_hf_state(whole: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """HF state dict (padding stripped, HF names) from whole Megatron tensors."""
    _check_megatron_state(whole, arch)
    out: dict[str, torch.Tensor] = {}
    for rule in tensor_rules(arch):
        for layer in layer_indices(rule, arch):
            tensor = whole[rule.megatron_key]
            out.update(hf_tensors(rule, layer=layer, tensor=tensor[layer] if layer is not None else tensor))
    return {name: out[name] for name in expected_hf_shapes(arch)}


# --- HF config -----------------------------------------------------------------------------------


def check_hf_config(config: dict[str, Any], *, source: str) -> None:
    """Refuse config fields that :class:`ModelArch` cannot represent (on top of its own checks)."""
    model_type = config.get("model_type")
    if config.get("quantization_config"):
        raise ValueError(f"{source}: quantized checkpoints (quantization_config) are not supported")
    if config.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported (the Megatron model has no MLP biases)")
    if config.get("attention_bias") and model_type not in ("qwen2", "mistral"):  # both ignore it
        raise ValueError(
            f"{source}: attention_bias=true is not supported for {model_type} (it adds an o_proj bias; "
            "only Qwen2's q/k/v biases are supported)"
        )
    if config.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor={config['partial_rotary_factor']} is not supported")
    layer_types = config.get("layer_types") or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        raise ValueError(f"{source}: layer_types {odd} are not supported (only full_attention)")
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"{source}: rope_theta must be a number, got {theta!r}")
    if float(theta) != int(float(theta)):
        raise ValueError(f"{source}: rope_theta={theta} is not supported (Megatron's rotary base is an integer)")


def arch_from_hf_config(config: dict[str, Any], *, source: str = "config.json") -> ModelArch:
    """Checked :class:`ModelArch` of an HF ``config.json`` dict."""
    model_type = config.get("model_type")
    if model_type in _ARCHITECTURES:
        check_hf_config(config, source=source)
    return ModelArch.from_hf_config(config, source=source)


def hf_config_from_arch(arch: ModelArch, *, dtype: str = "float32") -> dict[str, Any]:
    """A minimal HF ``config.json`` for ``arch`` (used when the original config is not available)."""
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch.model_type]],
        "model_type": arch.model_type,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "torch_dtype": dtype,
    }
    if arch.rope_scaling is not None:
        config["rope_scaling"] = dict(arch.rope_scaling)
    if arch.model_type == "mistral":
        config["sliding_window"] = None
    if arch.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config["use_sliding_window"] = False
    if arch.is_moe:
        config.update(num_experts=arch.num_experts, num_experts_per_tok=arch.num_experts_per_tok,
                      moe_intermediate_size=arch.moe_intermediate_size, norm_topk_prob=arch.norm_topk_prob,
                      decoder_sparse_step=arch.decoder_sparse_step, mlp_only_layers=list(arch.mlp_only_layers))
    if arch.model_type != "qwen2":
        config["attention_bias"] = arch.qkv_bias
    return config
