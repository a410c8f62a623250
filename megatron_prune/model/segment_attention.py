"""Core attention that computes only the query-key pairs a :class:`SegmentLayout` allows.

Each segment's queries attend to ``[prefix K/V ; own K/V]``, causally inside the segment and
offset by the prefix length, so a row ``[prompt, c1, ..., cG]`` costs
``sum len(c) * (len(prompt) + len(c))`` instead of the ``(P + sum C)^2`` of a dense mask;
gradients of every segment flow back into the one copy of the prefix (the gathers' backward adds
them). A padding position (covered by no segment) attends to itself only: its output is its own
value vector.

How the layout gets here: :class:`~megatron_prune.model.selective_gpt.SelectiveGPTModel` passes
``SegmentLayout.to_table()`` (an int64 ``[b, n, 4]`` tensor) as the decoder's ``attention_mask``,
because a tensor flows unchanged through Megatron's transformer block, its full recomputation
(which saves its inputs with ``save_for_backward``, which refuses Python objects) and every
pipeline stage, while a Python object or a global would not survive recomputation in a
backward pass that runs after other microbatches' forwards. Any other ``attention_mask`` (a
dense bool mask, or None for causal) goes to the parent class unchanged, so without segments
the layer is Megatron's own attention, bit for bit — except a single query per row with no mask
outside training (KV-cached decoding), which :class:`SegmentAttention` computes per key/value
group instead of copying the cache for every query head (:mod:`~megatron_prune.model.decode_attention`).

Paths: on CPU (and in fp32) PyTorch's ``scaled_dot_product_attention`` on padded groups of
similar-length segments, one call per group (fp16/bf16 inputs are computed in fp32, as Megatron's
softmax is). A prompt and the response that follows it directly are first joined into one causal
segment (:func:`_merge_contiguous_prefixes`); groups of prefix-less segments run SDPA's own
causal rule with no mask, the others the group's boolean mask. On a CUDA device with
fp16/bf16 activations and the ``flash_attn`` package, ``flash_attn_varlen_func`` with separate
query and key lengths (each segment's query block against its gathered ``[prefix ; own]`` keys;
flash's causal mask is bottom-right aligned when there are fewer queries than keys, which is
exactly the prefix offset). The GPU path has not been run in this project's CI (no GPU there).

Prefix keys/values across two forwards (:class:`PrefixKV`): inside :func:`capture_prefix_kv` every
layer stores the (detached) keys and values it computed; inside :func:`attend_to_prefix_kv` a
later forward's layers put those stored keys and values in front of their own, so its segments can
take a prefix from the earlier forward's rows without running that prefix again. The later forward
runs one row; the stored rows are laid end to end in front of it (stored row ``r``'s position
``p`` is position ``r * s + p``), so its segments pack the continuations of every stored row with
no padding between them. DPO's branch pruning uses it: the pruned response runs without
gradients on the prompt keys and values of the training pass. The store holds every layer's keys and values until the later forward is done
(a small part of what the training pass saves for its backward). Layers are told apart by
``layer_number``, so both forwards must run the same layers: under pipeline parallelism each stage
runs both forwards of a microbatch in one forward step (``megatron_prune.dpo.step``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import dataclass, field

import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_prune.model.decode_attention import single_query_attention
from megatron_prune.model.segments import TABLE_FIELDS, Segment, SegmentLayout

__all__ = [
    "PrefixKV",
    "SegmentAttention",
    "SegmentAttentionMixin",
    "attend_to_prefix_kv",
    "capture_prefix_kv",
    "is_segment_table",
    "prefix_kv_length",
    "segment_attention",
]

# A new group of padded segments starts when a segment's key count exceeds the group's first by
# this factor: bounds the padding work to < 2x the real pairs (segments are sorted by key count).
_GROUP_GROWTH = 1.5


def is_segment_table(attention_mask) -> bool:
    """Whether ``attention_mask`` is a :meth:`SegmentLayout.to_table` tensor (not a bool mask)."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.long
        and attention_mask.dim() == 3
        and attention_mask.shape[-1] == TABLE_FIELDS
    )


@dataclass
class _Group:
    q_index: torch.Tensor  # [n, Lq] flat (position * b + row) query indices, padded with 0
    k_index: torch.Tensor  # [n, Lk] flat key indices: prefix, then own tokens
    allowed: torch.Tensor | None  # [n, 1, Lq, Lk] bool, True = attend; None: plain causal (no prefix)
    q_valid: torch.Tensor  # [n, Lq] bool: real queries


@dataclass
class _Plan:
    groups: list[_Group]
    pad_index: torch.Tensor  # [m] flat key positions of the queries covered by no segment
    out_order: torch.Tensor  # [s_q*b]: row of cat(group outputs, padding outputs) for each flat query
    # flash path: concatenated queries / keys and their cumulative lengths
    q_flat: torch.Tensor
    k_flat: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _merge_contiguous_prefixes(row: list[Segment]) -> list[Segment]:
    """``row`` with each prefix-less segment and the first segment that continues it directly, as
    its prefix, joined into one causal segment.

    The join attends the same pairs: the prefix's queries see their own keys causally either way,
    and the continuation's queries see the whole prefix and their own keys up to themselves. It
    turns ``[prompt, response]`` (a packed or pruned DPO row, a GRPO group's first completion)
    into one prefix-less segment, which runs as plain causal attention without a mask. Other
    segments that take the same prefix keep it: the prefix's positions are still its keys.
    """
    by_span = {(seg.start, seg.end): i for i, seg in enumerate(row) if seg.length and not seg.prefix_length}
    merged = list(row)
    joined: set[int] = set()
    for i, seg in enumerate(row):
        if not seg.length or not seg.prefix_length or seg.prefix_end != seg.start:
            continue
        j = by_span.get((seg.prefix_start, seg.prefix_end))
        if j is None or j in joined:
            continue
        joined.add(j)
        merged[j] = Segment(seg.prefix_start, seg.end)
        merged[i] = Segment(seg.end, seg.end)  # empty: covered by the joined segment
    return merged


def _build_plan(layout: SegmentLayout, device: torch.device, queries_from: int = 0) -> _Plan:
    """Gathers for ``layout``; positions before ``queries_from`` are keys only (no query, no output),
    and query indices count from there (flat ``(p - queries_from) * b + r``)."""
    s, b = layout.seq_length, layout.batch_size
    shift = queries_from * b
    segs = []  # (row, first query, query count, first prefix key, prefix length) per segment
    for r, row in enumerate(layout.rows):
        for seg in _merge_contiguous_prefixes(row):
            if seg.length == 0:
                continue
            assert seg.start >= queries_from, "a segment's queries lie before the first query position"
            segs.append((r, seg.start, seg.length, seg.prefix_start, seg.prefix_length))
    # Prefix-less segments first, grouped apart from the others: their groups need no mask.
    key_count = lambda item: item[2] + item[4]  # noqa: E731
    segs.sort(key=lambda item: (item[4] > 0, key_count(item)))
    groups, members = [], []
    for item in segs:
        if members and (key_count(item) > _GROUP_GROWTH * key_count(members[0]) or (item[4] > 0) != (members[0][4] > 0)):
            groups.append(members)
            members = []
        members.append(item)
    if members:
        groups.append(members)
    built, flat_q, flat_k = [], [], []
    for members in groups:
        row, start, length, prefix_start, prefix = (torch.tensor(col, dtype=torch.long)[:, None] for col in zip(*members))
        i = torch.arange(max(m[2] for m in members))[None, :]  # query slot
        j = torch.arange(max(key_count(m) for m in members))[None, :]  # key slot: prefix, then own tokens
        q_valid = i < length
        q_index = torch.where(q_valid, (start + i) * b + row - shift, 0)
        k_valid = j < prefix + length
        k_pos = torch.where(j < prefix, prefix_start + j, start + j - prefix)
        k_index = torch.where(k_valid, k_pos * b + row, 0)
        flat_q.append(q_index[q_valid])
        flat_k.append(k_index[k_valid])
        # Query i sees the prefix and own keys up to itself; padded query rows copy the last real
        # row (never a fully masked row), their outputs are dropped. Without a prefix that is
        # SDPA's own causal rule (a real query never reaches the padded keys after it), which
        # needs no mask and lets the kernel skip the blocks above the diagonal.
        allowed = None
        if members[0][4] > 0:
            own = j[:, None, :] - prefix[:, :, None]
            last = torch.minimum(i, length - 1)[:, :, None]
            allowed = (j[:, None, :] < prefix[:, :, None]) | ((own >= 0) & (own <= last))
            allowed = allowed[:, None].to(device)
        built.append(_Group(q_index.to(device), k_index.to(device), allowed, q_valid.to(device)))
    outputs = torch.cat(flat_q) if flat_q else torch.zeros(0, dtype=torch.long)
    covered = torch.zeros(s * b - shift, dtype=torch.bool)
    covered[outputs] = True
    uncovered = (~covered).nonzero().flatten()  # padding queries; their keys sit ``shift`` further on
    order = torch.cat([outputs, uncovered])
    out_order = torch.empty(s * b - shift, dtype=torch.long)
    out_order[order] = torch.arange(s * b - shift)
    lengths_q = [m[2] for m in segs]
    lengths_k = [key_count(m) for m in segs]
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return _Plan(
        groups=built, pad_index=(uncovered + shift).to(device), out_order=out_order.to(device),
        q_flat=outputs.to(device), k_flat=(torch.cat(flat_k) if flat_k else torch.zeros(0, dtype=torch.long)).to(device),
        cu_q=cu_q.to(device), cu_k=cu_k.to(device),
        max_q=max(lengths_q, default=0), max_k=max(lengths_k, default=0),
    )


# Every layer of a stage receives the same table: its plan is built once and reused. The key is
# the table's storage, not the tensor object, because recomputation (activation checkpointing)
# hands each layer a detached copy of it; the cache holds the table, so that storage is not reused.
_plan_cache: dict = {"key": None, "table": None, "plan": None}


def _plan_for(table: torch.Tensor, seq_length: int, device: torch.device, queries_from: int = 0) -> _Plan:
    key = (table.data_ptr(), tuple(table.shape), table._version, device, seq_length, queries_from)
    if _plan_cache["key"] == key:
        return _plan_cache["plan"]
    plan = _build_plan(SegmentLayout.from_table(table.cpu(), seq_length=seq_length), device, queries_from)
    _plan_cache.update(key=key, table=table, plan=plan)
    return plan


def _flash_for(query: torch.Tensor, *, deterministic: bool = False):
    """``flash_attn_varlen_func`` where it can run ``query``, else None (the SDPA path): CUDA on
    Ampere or newer, fp16/bf16, flash-attn 2.1 or newer (2.0 aligns the causal mask to the top left
    when a segment has fewer queries than keys: its queries would see the first keys of the prefix
    instead of their own tokens), head size up to 256 (over 192 only on A100/H100 before 2.5.5,
    which added that backward elsewhere), and 2.4.1 or newer for a deterministic backward (the
    first release that takes the keyword)."""
    head = query.shape[-1]
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or head > 256:
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return None
    capability = tuple(torch.cuda.get_device_capability(query.device))
    if capability[0] < 8:
        return None
    import flash_attn
    from packaging.version import Version

    version = Version(flash_attn.__version__)
    if version < Version("2.1") or (deterministic and version < Version("2.4.1")):
        return None
    if head > 192 and capability not in ((8, 0), (9, 0)) and version < Version("2.5.5"):
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    softmax_in_fp32: bool = True,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention of ``query`` ``[s_q, b, np, hn]`` over ``key``/``value`` ``[s, b, ng, hn]`` as the
    segment ``table`` (over ``s`` positions) allows; returns ``[s_q, b, np * hn]`` (Megatron's
    core-attention layout).

    The queries are the last ``s_q`` positions (all of them when ``s_q == s``); the positions
    before them are keys only, which segments may take as their prefix. Query head ``h`` uses
    key/value group ``h // (np / ng)`` (grouped-query attention, as Megatron's
    ``repeat_interleave``); the scale defaults to ``1 / sqrt(hn)``. ``deterministic`` asks the
    flash-attention kernel for its deterministic backward (the SDPA path is deterministic on CPU).
    """
    s_q, b, np_, hn = query.shape
    s, ng = key.shape[0], key.shape[2]
    assert np_ % ng == 0 and key.shape[1] == b and s >= s_q and value.shape == key.shape, "bad attention shapes"
    rep = np_ // ng
    scale = 1.0 / math.sqrt(hn) if softmax_scale is None else softmax_scale
    plan = _plan_for(table, s, query.device, queries_from=s - s_q)
    q = query.reshape(s_q * b, np_, hn)
    k = key.reshape(s * b, ng, hn)
    v = value.reshape(s * b, ng, hn)
    pieces = []
    flash = _flash_for(query, deterministic=deterministic)
    if flash is not None and plan.q_flat.numel():
        pieces.append(flash(
            q.index_select(0, plan.q_flat), k.index_select(0, plan.k_flat), v.index_select(0, plan.k_flat),
            plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, dropout_p=0.0, softmax_scale=scale, causal=True,
            **({"deterministic": True} if deterministic else {}),
        ))
    else:
        compute = torch.float32 if softmax_in_fp32 and query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        for group in plan.groups:
            n, lq = group.q_index.shape
            lk = group.k_index.shape[1]
            qg = q.index_select(0, group.q_index.flatten()).view(n, lq, np_, hn).transpose(1, 2)
            kg = k.index_select(0, group.k_index.flatten()).view(n, lk, ng, hn).transpose(1, 2)
            vg = v.index_select(0, group.k_index.flatten()).view(n, lk, ng, hn).transpose(1, 2)
            context = torch.nn.functional.scaled_dot_product_attention(
                qg.to(compute), kg.to(compute), vg.to(compute), attn_mask=group.allowed, scale=scale,
                is_causal=group.allowed is None, enable_gqa=rep > 1,
            ).to(query.dtype)  # [n, np, lq, hn]
            pieces.append(context.transpose(1, 2)[group.q_valid])
    pieces.append(v.index_select(0, plan.pad_index).repeat_interleave(rep, dim=1))
    out = torch.cat(pieces).index_select(0, plan.out_order)
    return out.view(s_q, b, np_ * hn)


@dataclass
class PrefixKV:
    """Keys and values of one forward's segment-attention layers, keyed by ``layer_number``."""

    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """``layer_number -> (key, value)``, each ``[s, b, ng, hn]`` and detached."""

    @property
    def seq_length(self) -> int:
        """Positions the stored rows take laid end to end: ``s * b`` of the captured forward (0 before)."""
        if not self.layers:
            return 0
        shape = next(iter(self.layers.values()))[0].shape
        return shape[0] * shape[1]


# The capture or replay in progress; set only inside the context managers below.
_prefix_kv: dict = {"capture": None, "replay": None}


@contextlib.contextmanager
def capture_prefix_kv(store: PrefixKV):
    """Every segment-attention layer run inside stores its keys and values in ``store``."""
    assert _prefix_kv["capture"] is None and _prefix_kv["replay"] is None, "prefix K/V contexts do not nest"
    _prefix_kv["capture"] = store
    try:
        yield store
    finally:
        _prefix_kv["capture"] = None


@contextlib.contextmanager
def attend_to_prefix_kv(store: PrefixKV):
    """Segment-attention layers run inside see ``store``'s keys and values in front of their own.

    Such a forward runs one row. Its segment table covers ``store.seq_length`` positions, the
    stored rows laid end to end, followed by the forward's own tokens; only the latter are
    queries. Runs without gradients: the stored keys and values are detached.
    """
    assert _prefix_kv["capture"] is None and _prefix_kv["replay"] is None, "prefix K/V contexts do not nest"
    if not store.layers:
        raise ValueError("no prefix keys and values were captured")
    _prefix_kv["replay"] = store
    try:
        with torch.no_grad():
            yield store
    finally:
        _prefix_kv["replay"] = None


def prefix_kv_length() -> int:
    """Positions the stored prefix adds in front of the current forward's rows (0 outside a replay)."""
    store = _prefix_kv["replay"]
    return 0 if store is None else store.seq_length


class SegmentAttentionMixin:
    """Adds the segment path to a core-attention class: a segment table as ``attention_mask``
    runs :func:`segment_attention`; anything else runs the parent class unchanged."""

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if not is_segment_table(attention_mask):
            return super().forward(query, key, value, attention_mask, *args, **kwargs)
        self._check_segment_support(kwargs)
        capture, replay = _prefix_kv["capture"], _prefix_kv["replay"]
        if capture is not None:
            assert self.layer_number not in capture.layers, "a layer ran twice in one prefix capture"
            capture.layers[self.layer_number] = (key.detach(), value.detach())
        if replay is not None:
            assert key.shape[1] == 1, "a forward on stored keys and values runs one row"

            def end_to_end(stored: torch.Tensor) -> torch.Tensor:  # [s, b, ...] -> [b * s, 1, ...]
                return stored.transpose(0, 1).reshape(-1, 1, *stored.shape[2:]).to(key.dtype)

            stored_key, stored_value = replay.layers[self.layer_number]
            assert stored_key.shape[2:] == key.shape[2:], "the replay's heads do not match the captured heads"
            # The stored positions are keys only: the queries stay this forward's own tokens.
            key = torch.cat([end_to_end(stored_key), key])
            value = torch.cat([end_to_end(stored_value), value])
        return segment_attention(
            query, key, value, attention_mask,
            softmax_scale=self._segment_softmax_scale(),
            softmax_in_fp32=bool(self.config.attention_softmax_in_fp32),
            deterministic=bool(getattr(self.config, "deterministic_mode", False)),
        )

    def _segment_softmax_scale(self) -> float:
        # Megatron's local attention keeps its scale; Transformer Engine's keeps it only inside its
        # backends, so the config's (when set) and then the default stand in for it there.
        for scale in (getattr(self, "softmax_scale", None), getattr(self.config, "softmax_scale", None)):
            if scale is not None:
                return scale
        return 1.0 / math.sqrt(self.config.kv_channels)

    def _check_segment_support(self, kwargs) -> None:
        config = self.config
        if kwargs.get("packed_seq_params") is not None or kwargs.get("attention_bias") is not None:
            raise ValueError("segment attention does not combine with packed_seq_params or an attention bias")
        if config.apply_query_key_layer_scaling or config.window_size is not None:
            raise ValueError("segment attention does not support query-key layer scaling or windowed attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("segment attention needs the vanilla softmax")
        if self.training and config.attention_dropout > 0:
            raise ValueError("segment attention does not implement attention dropout; set it to 0")


class SegmentAttention(SegmentAttentionMixin, DotProductAttention):
    """Megatron's ``DotProductAttention`` (local layer spec) with the segment path, and with
    :func:`~megatron_prune.model.decode_attention.single_query_attention` for a single unmasked
    query per row outside training (KV-cached decoding)."""

    decodes_per_group = True
    """Read by the self-attention's KV cache, which is then laid out for the per-group path."""

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is None and query.shape[0] == 1 and self._plain_decoding(args, kwargs):
            return single_query_attention(query, key, value, softmax_scale=self.softmax_scale,
                                          softmax_in_fp32=bool(self.config.attention_softmax_in_fp32))
        return super().forward(query, key, value, attention_mask, *args, **kwargs)

    def _plain_decoding(self, args, kwargs) -> bool:
        """Whether Megatron would compute plain softmax attention with no mask, no dropout, no bias."""
        config = self.config
        return (not self.training and len(args) <= 1 and kwargs.get("attention_bias") is None
                and kwargs.get("packed_seq_params") is None and config.window_size is None
                and not config.apply_query_key_layer_scaling
                and getattr(config, "softmax_type", "vanilla") == "vanilla")


_SEGMENT_CLASSES: dict[type, type] = {DotProductAttention: SegmentAttention}


def segment_core_attention(cls: type) -> type:
    """``cls`` (a core-attention class, e.g. Transformer-Engine's) with the segment path added."""
    if issubclass(cls, SegmentAttentionMixin):
        return cls
    if cls not in _SEGMENT_CLASSES:
        _SEGMENT_CLASSES[cls] = type(f"Segment{cls.__name__}", (SegmentAttentionMixin, cls), {})
    return _SEGMENT_CLASSES[cls]


def with_segment_attention(layer_spec):
    """A transformer-layer ``ModuleSpec`` whose self-attention's core attention has the segment path."""
    import dataclasses

    attn = layer_spec.submodules.self_attention
    core = getattr(getattr(attn, "submodules", None), "core_attention", None)
    if not isinstance(core, type):  # no core attention, or a nested ModuleSpec
        return layer_spec
    attn = dataclasses.replace(
        attn, submodules=dataclasses.replace(attn.submodules, core_attention=segment_core_attention(core))
    )
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn))
