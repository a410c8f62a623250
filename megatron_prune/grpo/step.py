"""The GRPO training passes on Megatron's schedules: layout, old / reference log-probs, update.

The surviving completions of a rollout (:class:`TrainItem`) are laid out as rows — one
padded sequence per row, or densely packed (window-based first-fit-decreasing, one attention
segment per sequence, restarting position ids) — and run through the selective head, which scores
exactly the completion tokens. With ``shared_prompt`` the unit laid out is a prompt's group,
``[prompt, c1, ..., ck]``: one prompt copy that every completion attends to (segment attention,
:mod:`megatron_prune.model.segment_attention`), each completion's positions continuing from the
prompt's end. A pass runs only the rows its items need: as few microbatches as
``micro_batch_size`` allows with the rows spread evenly over them (never padded up to
``micro_batch_size``; under pipeline parallelism every microbatch has the shape of the largest),
packed rows as long as the fullest one; ``Layout.density`` is that of what runs. Under expert
parallelism (the ranks of an expert-parallel group run each MoE forward together) every
data-parallel rank runs as many microbatches as the busiest one, and under the interleaved
pipeline schedule every pass runs a multiple of the stages; the extra ones are placeholders
without items. Forward-only passes (old policy, reference) run under
``no_grad`` through Megatron's forward-only schedule; the update runs forward-backward with
the GRPO token loss (:func:`megatron_prune.grpo.loss.grpo_loss`) on the last stage.

Scaling: the loss of a microbatch is ``sum over its tokens (w * term) / Z`` with ``Z`` fixed
by the caller from the unpruned batch. Megatron divides each microbatch loss by the number of
microbatches and DDP averages over data-parallel ranks, so the loss handed to the schedule is
multiplied by ``num_microbatches * dp``: the accumulated gradient is then the gradient of the
plain sum over every microbatch of every rank, whatever the layout.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_prune.data.packing import pack_sequences
from megatron_prune.grpo.loss import GRPOLossConfig, grpo_loss
from megatron_prune.model.segments import Segment, SegmentLayout
from megatron_prune.model.selective_gpt import TokenSelection
from megatron_prune.training.parallel import schedule_microbatches
from megatron_prune.training.step import run_schedule

__all__ = ["TrainItem", "GRPOStepSettings", "GRPOMicrobatch", "GRPOStep", "Layout", "layout_items", "microbatch_rows",
           "sum_metrics", "pad_microbatches"]

SUMMED = ("loss", "policy_loss", "kl_loss")
"""Metrics summed over microbatches and ranks (parts of the global loss)."""
AVERAGED = ("clip_fraction", "ratio_mean", "kl")
"""Metrics averaged over the trained tokens."""


@dataclass
class TrainItem:
    """One kept completion, ready to train on."""

    prompt_id: Hashable
    """Id of its prompt."""
    index: int
    """j: its index in the prompt's group."""
    prompt: list[int]
    """Prompt tokens."""
    completion: list[int]
    """Completion tokens (the scored ones)."""
    advantage: float
    """Group-relative advantage, computed on the full group."""
    weight: float = 1.0
    """DPPO importance weight ``1/(p_i q_ij)`` (1 without pruning)."""
    old_logprobs: torch.Tensor | None = None
    """Log-probs under the rollout policy (None: the current policy's, detached)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference log-probs (for the KL term)."""

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclass(kw_only=True)
class GRPOStepSettings:
    """Fixed settings of the GRPO passes."""

    loss: GRPOLossConfig
    """Clipping and KL."""
    micro_batch_size: int
    """Most rows per microbatch (a pass runs only the rows its items need)."""
    pad_id: int
    """Padding token."""
    normalization: str = "constant"
    """constant: token sum / Z; sequence: per-sequence mean, / Z (Z then counts sequences)."""
    dense_packing: bool = False
    """Pack sequences into rows of ``pack_capacity`` tokens."""
    pack_capacity: int = 1024
    """Row length of packed rows."""
    pack_window: int = 64
    """Window of the first-fit-decreasing packer."""
    shared_prompt: bool = False
    """Lay each prompt's items out as ``[prompt, c1, ..., ck]`` (one prompt copy; every completion
    attends to it and to itself, positions continuing from the prompt's end): the same log-probs,
    fewer tokens. Groups longer than ``pack_capacity`` are split, each part with its own copy."""
    pad_multiple: int = 8
    """Row lengths are padded to a multiple of this (and of TP)."""
    temperature: float = 1.0
    """Sampling temperature of the rollout: training log-probs divide the logits by it, so the
    PPO ratio compares the same (tempered) distribution that sampled the tokens. 0 (greedy
    rollout) trains at temperature 1."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.normalization not in ("constant", "sequence"):
            raise ValueError(f"normalization must be constant or sequence, got {self.normalization!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")


@dataclass
class GRPOMicrobatch:
    """Tensors of one forward pass and the items it scores (in ``seq_ids`` order)."""

    tokens: torch.Tensor
    """[b, s]."""
    position_ids: torch.Tensor
    """[b, s]: restarting at 0 in every packed sequence; with ``segments`` the model takes each
    token's rotary position from here."""
    attention_mask: torch.Tensor | None
    """Always None: plain causal for padded rows; packed rows use ``segments``."""
    selection: TokenSelection
    """Completion-token positions."""
    items: list[TrainItem]
    """Items scored by this microbatch; empty for a placeholder."""
    extras: dict = field(default_factory=dict)
    segments: SegmentLayout | None = None
    """Packed rows: one causal segment per sequence (attention computed per sequence, not per row)."""
    padding_mask: torch.Tensor | None = None
    """[b, s] bool, True at padding (kept out of a mixture-of-experts model's router losses)."""


@dataclass
class Layout:
    """Microbatches of one pass and what they cost."""

    batches: list[GRPOMicrobatch]
    seq_length: int
    valid_tokens: int
    """Real tokens run through the model."""
    row_tokens: int
    """All token slots run (padding and placeholder rows included)."""
    micro_batch_size: int = 1
    """Rows of the largest microbatch (every microbatch has this many under pipeline parallelism)."""

    @property
    def density(self) -> float:
        return self.valid_tokens / self.row_tokens if self.row_tokens else 1.0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def microbatch_rows(num_rows: int, *, micro_batch_size: int, equal_shapes: bool) -> list[tuple[int, int, int]]:
    """``(first row, real rows, rows run)`` of each microbatch of ``num_rows`` rows.

    As few microbatches as ``micro_batch_size`` allows, the rows spread evenly over them (sizes
    differ by at most one), so no microbatch is padded up to ``micro_batch_size``. With
    ``equal_shapes`` (pipeline parallelism: the schedule's p2p buffers have one shape) every
    microbatch runs as many rows as the largest; the few padding rows this adds are fewer than the
    number of microbatches and never make a microbatch all padding.
    """
    num_rows = max(num_rows, 1)
    count = -(-num_rows // micro_batch_size)
    base, extra = divmod(num_rows, count)
    sizes = [base + (k < extra) for k in range(count)]
    starts = [sum(sizes[:k]) for k in range(count)]
    run = max(sizes)
    return [(start, size, run if equal_shapes else size) for start, size in zip(starts, sizes)]


@dataclass
class _Unit:
    """Items laid out together: one item, or (``--shared-prompt``) a group's items behind one
    copy of their prompt, ``[prompt, c1, ..., ck]``."""

    items: list[TrainItem]
    shared: bool = False

    @property
    def prompt(self) -> list[int]:
        return self.items[0].prompt

    @property
    def length(self) -> int:
        return len(self.prompt) + sum(len(it.completion) for it in self.items)

    def tokens(self) -> list[int]:
        return self.prompt + [t for it in self.items for t in it.completion]

    def positions(self) -> torch.Tensor:
        """Every completion continues from the prompt's end."""
        p = len(self.prompt)
        return torch.cat([torch.arange(p)] + [torch.arange(p, p + len(it.completion)) for it in self.items])

    def segments(self, offset: int) -> list[Segment]:
        if not self.shared:
            return [Segment(offset, offset + self.length)]
        p = len(self.prompt)
        out, start = [Segment(offset, offset + p)], offset + p
        for it in self.items:
            out.append(Segment(start, start + len(it.completion), offset, offset + p))
            start += len(it.completion)
        return out

    def scored_positions(self, offset: int) -> list[torch.Tensor]:
        """Per item: where each completion token is predicted (its first from the prompt's last token)."""
        p = len(self.prompt)
        out, start = [], offset + p
        for it in self.items:
            positions = start - 1 + torch.arange(len(it.completion))
            if len(it.completion):
                positions[0] = offset + p - 1
            out.append(positions)
            start += len(it.completion)
        return out


def _units(items: list[TrainItem], *, shared: bool, capacity: int) -> list[_Unit]:
    """One unit per item; with ``shared`` one per group of items with the same prompt (in order of
    first appearance), split where a group would exceed ``capacity`` tokens."""
    if not shared:
        return [_Unit([it]) for it in items]
    groups: dict = {}
    for it in items:
        groups.setdefault((it.prompt_id, tuple(it.prompt)), []).append(it)
    units = []
    for members in groups.values():
        current = _Unit([], shared=True)
        for it in members:
            if current.items and current.length + len(it.completion) > capacity:
                units.append(current)
                current = _Unit([], shared=True)
            current.items.append(it)
        units.append(current)
    return units


def _selection(placements: list[tuple[int, int, _Unit]], num_rows: int, temperature: float | None = None) -> TokenSelection:
    """Scored positions of the items of units placed at ``(row, offset)``, item by item."""
    index, labels, seq_ids = [], [], []
    k = 0
    for row, offset, unit in placements:
        for item, positions in zip(unit.items, unit.scored_positions(offset)):
            index.append(positions * num_rows + row)
            labels.append(torch.tensor(item.completion, dtype=torch.long))
            seq_ids.append(torch.full((len(item.completion),), k, dtype=torch.long))
            k += 1
    if not index:  # a placeholder scores one padding position with weight 0
        zero = torch.zeros(1, dtype=torch.long)
        return TokenSelection(index=zero, labels=zero.clone(), seq_ids=zero.clone(), temperature=temperature)
    return TokenSelection(index=torch.cat(index), labels=torch.cat(labels), seq_ids=torch.cat(seq_ids),
                          temperature=temperature)


def _train_temperature(settings: GRPOStepSettings) -> float | None:
    """Temperature handed to the selective head (None = 1: the plain log-softmax)."""
    t = settings.temperature
    return None if t in (0.0, 1.0) else float(t)


def _microbatch(rows_of_units: list[list[tuple[int, _Unit]]], *, rows: int, length: int,
                settings: GRPOStepSettings, with_segments: bool) -> GRPOMicrobatch:
    """Tensors of one microbatch: ``rows_of_units[r]`` lists ``(offset, unit)`` of real row ``r``;
    rows beyond them are placeholders (equal shapes under PP), one causal segment each."""
    tokens = torch.full((rows, length), settings.pad_id, dtype=torch.long)
    position_ids = torch.arange(length).repeat(rows, 1)
    segment_rows = [[Segment(0, length)] for _ in range(rows)]
    padding_mask = torch.ones((rows, length), dtype=torch.bool)
    placements = []
    for r, placed in enumerate(rows_of_units):
        segment_rows[r] = []
        for offset, unit in placed:
            tokens[r, offset : offset + unit.length] = torch.tensor(unit.tokens(), dtype=torch.long)
            padding_mask[r, offset : offset + unit.length] = False
            position_ids[r, offset : offset + unit.length] = unit.positions()
            segment_rows[r].extend(unit.segments(offset))
            placements.append((r, offset, unit))
    selection = _selection(placements, rows, _train_temperature(settings))
    segments = SegmentLayout(rows=segment_rows, seq_length=length) if with_segments else None
    return GRPOMicrobatch(tokens, position_ids, None, selection, [it for _, _, u in placements for it in u.items],
                          segments=segments, padding_mask=padding_mask)


def _padded_rows(units: list[_Unit], *, settings: GRPOStepSettings, multiple: int, equal_shapes: bool) -> Layout:
    length = _round_up(max((u.length for u in units), default=1), multiple)
    batches, slots = [], 0
    for start, real, rows in microbatch_rows(len(units), micro_batch_size=settings.micro_batch_size,
                                             equal_shapes=equal_shapes):
        placed = [[(0, unit)] for unit in units[start : start + real]]
        batches.append(_microbatch(placed, rows=rows, length=length, settings=settings,
                                   with_segments=settings.shared_prompt))
        slots += rows * length
    return Layout(batches, length, sum(u.length for u in units), slots,
                  max(b.tokens.shape[0] for b in batches))


def _packed_rows(units: list[_Unit], *, settings: GRPOStepSettings, multiple: int, capacity: int,
                 equal_shapes: bool) -> Layout:
    longest = max((u.length for u in units), default=1)
    if longest > capacity:
        raise ValueError(f"a prompt + completion of {longest} tokens does not fit the packing capacity {capacity}; "
                         "raise --seq-length")
    if not units:
        return _padded_rows(units, settings=settings, multiple=multiple, equal_shapes=equal_shapes)
    plan = pack_sequences([u.length for u in units], capacity=capacity, window=settings.pack_window)
    # Rows are as long as the fullest row needs (the tail every row leaves empty is not run).
    length = _round_up(max(row.used for row in plan.rows), multiple)
    batches, slots = [], 0
    for start, real, rows in microbatch_rows(plan.num_rows, micro_batch_size=settings.micro_batch_size,
                                             equal_shapes=equal_shapes):
        placed = [[(offset, units[index]) for index, offset in zip(row.sequence_indices, row.offsets)]
                  for row in plan.rows[start : start + real]]
        batches.append(_microbatch(placed, rows=rows, length=length, settings=settings, with_segments=True))
        slots += rows * length
    return Layout(batches, length, plan.total_tokens, slots, max(b.tokens.shape[0] for b in batches))


def layout_items(items: list[TrainItem], *, settings: GRPOStepSettings, tp: int = 1, pp: int = 1) -> Layout:
    """Rows and microbatches of ``items`` (at least one microbatch, a one-row placeholder when
    empty): only as many rows as the items need, at most ``micro_batch_size`` per microbatch,
    every microbatch the same shape when ``pp > 1``."""
    multiple = math.lcm(settings.pad_multiple, tp)
    capacity = _round_up(settings.pack_capacity, multiple)
    units = _units(items, shared=settings.shared_prompt, capacity=capacity)
    if settings.dense_packing:
        return _packed_rows(units, settings=settings, multiple=multiple, capacity=capacity, equal_shapes=pp > 1)
    return _padded_rows(units, settings=settings, multiple=multiple, equal_shapes=pp > 1)


def _forward_step(data_iterator, model):
    from megatron_prune.model.moe import router_loss_scale

    batch: GRPOMicrobatch = next(data_iterator)
    # A training microbatch carries its router-loss weight (a placeholder 0: a MoE router's losses on
    # its pad rows would still move the weights); forward-only passes add no router losses.
    scale = batch.extras.get("router_scale")
    with router_loss_scale(model, scale) if scale is not None else contextlib.nullcontext():
        output = model(batch.tokens, batch.position_ids, batch.attention_mask, token_selection=batch.selection,
                       segments=batch.segments, padding_mask=batch.padding_mask)
    return output, partial(batch.extras["loss_func"], batch)


def _collect_logps(batch: GRPOMicrobatch, logps: torch.Tensor):
    return torch.zeros((), device=logps.device), {"logps": logps.detach().float().cpu()}


def _split(logps: torch.Tensor, items: Sequence[TrainItem]) -> list[torch.Tensor]:
    return list(torch.split(logps, [len(it.completion) for it in items]))


def _sum_count(value: torch.Tensor, count: float) -> torch.Tensor:
    return torch.stack([value.detach().double().cpu().reshape(()) * count, torch.tensor(float(count), dtype=torch.float64)])


def sum_metrics(outputs: list[dict], names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """``name -> (sum, count)`` over microbatches and data-parallel ranks, known on every rank."""
    totals = torch.zeros(len(names), 2, dtype=torch.float64)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if last:
        for out in outputs:
            for i, name in enumerate(names):
                if name in out:
                    totals[i] += torch.as_tensor(out[name], dtype=torch.float64).reshape(2)
        if dist.is_initialized():
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return {name: (float(totals[i, 0]), float(totals[i, 1])) for i, name in enumerate(names)}


def pad_microbatches(layout: Layout, count: int, *, settings: GRPOStepSettings) -> Layout:
    """``layout`` with placeholder microbatches (one padding row, or as many rows as the others
    under pipeline parallelism; no items, so they add exactly zero to the loss, the gradient and
    the scored log-probs) appended up to ``count`` microbatches."""
    extra = count - len(layout.batches)
    if extra <= 0:
        return layout
    rows = layout.micro_batch_size if parallel_state.get_pipeline_model_parallel_world_size() > 1 else 1
    with_segments = layout.batches[0].segments is not None
    placeholders = [_microbatch([], rows=rows, length=layout.seq_length, settings=settings,
                                with_segments=with_segments) for _ in range(extra)]
    return Layout(layout.batches + placeholders, layout.seq_length, layout.valid_tokens,
                  layout.row_tokens + extra * rows * layout.seq_length, layout.micro_batch_size)


class GRPOStep:
    """Runs the forward-only and forward-backward passes of GRPO for this data-parallel rank."""

    def __init__(
        self, *, settings: GRPOStepSettings, policy: list[torch.nn.Module], reference: list[torch.nn.Module] | None = None
    ) -> None:
        if settings.loss.kl_beta > 0 and reference is None:
            raise ValueError("kl_beta > 0 needs a reference model")
        self.s = settings
        self.policy = policy
        self.reference = reference

    def layout(self, items: list[TrainItem]) -> Layout:
        """Microbatches of ``items``, padded with placeholders to what the schedule needs: under
        expert parallelism the most any data-parallel rank runs (collective over the data-parallel
        group then), under the interleaved schedule a multiple of the pipeline stages."""
        layout = layout_items(items, settings=self.s, tp=parallel_state.get_tensor_model_parallel_world_size(),
                              pp=parallel_state.get_pipeline_model_parallel_world_size())
        return pad_microbatches(layout, schedule_microbatches(len(layout.batches)), settings=self.s)

    def _run(self, model, layout: Layout, *, forward_only: bool) -> list[dict]:
        iterators = [iter(layout.batches) for _ in model] if len(model) > 1 else iter(layout.batches)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            return run_schedule(
                forward_step_func=_forward_step, data_iterator=iterators, model=model,
                num_microbatches=len(layout.batches), seq_length=layout.seq_length,
                micro_batch_size=layout.micro_batch_size, forward_only=forward_only,
            )

    def score(self, items: list[TrainItem], *, which: str) -> Layout:
        """Store ``old_logprobs`` (policy) or ``ref_logprobs`` (reference) on ``items`` (last stage)."""
        model = {"old": self.policy, "ref": self.reference}[which]
        if model is None:
            raise ValueError(f"no model for {which} log-probs")
        layout = self.layout(items)
        for batch in layout.batches:
            batch.extras["loss_func"] = _collect_logps
        outputs = self._run(model, layout, forward_only=True)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            for batch, out in zip(layout.batches, outputs):
                if not batch.items:  # a placeholder
                    continue
                for item, values in zip(batch.items, _split(out["logps"], batch.items)):
                    setattr(item, f"{which}_logprobs", values)
        return layout

    def train(self, items: list[TrainItem], *, normaliser: float) -> tuple[dict[str, float], Layout]:
        """Accumulate the gradient of ``sum over items / normaliser`` (all DP ranks together)."""
        layout = self.layout(items)
        dp = parallel_state.get_data_parallel_world_size()
        scale = len(layout.batches) * dp
        # Megatron weights a MoE router's losses by 1 / (microbatches x DP); placeholders (no items)
        # add none, so the real microbatches take their share: the weight then does not depend on
        # how many placeholders the layout needed (expert parallelism, the pipeline schedule).
        real = sum(1 for batch in layout.batches if batch.items)
        router_scale = len(layout.batches) / real if real else 0.0
        for batch in layout.batches:
            batch.extras["loss_func"] = partial(self._loss, scale=scale, normaliser=normaliser)
            batch.extras["router_scale"] = router_scale if batch.items else 0.0
        outputs = self._run(self.policy, layout, forward_only=False)
        sums = sum_metrics(outputs, SUMMED + AVERAGED)
        metrics = {name: sums[name][0] for name in SUMMED}
        metrics.update({name: sums[name][0] / sums[name][1] for name in AVERAGED if sums[name][1] > 0})
        # A MoE policy's router losses: added in this training pass only (collective on every rank).
        from megatron_prune.model.moe import pop_router_losses

        metrics.update(pop_router_losses(self.policy, num_microbatches=real))
        return metrics, layout

    def _loss(self, batch: GRPOMicrobatch, logps: torch.Tensor, *, scale: float, normaliser: float):
        items = batch.items
        if not items:
            return logps.sum() * 0.0, {}
        device = logps.device
        counts = torch.tensor([len(it.completion) for it in items], device=device)
        per_token = partial(torch.repeat_interleave, repeats=counts)
        advantages = per_token(torch.tensor([it.advantage for it in items], dtype=torch.float32, device=device))
        seq_weights = [it.weight / (len(it.completion) if self.s.normalization == "sequence" else 1.0) for it in items]
        weights = per_token(torch.tensor(seq_weights, dtype=torch.float32, device=device))
        old = torch.cat([
            it.old_logprobs.to(device) if it.old_logprobs is not None else values.detach()
            for it, values in zip(items, _split(logps, items))
        ])
        ref = None
        if self.s.loss.kl_beta > 0:
            ref = torch.cat([it.ref_logprobs for it in items]).to(device)[None]
        loss, stats = grpo_loss(
            logprobs=logps[None], old_logprobs=old[None], advantages=advantages[None],
            mask=torch.ones_like(logps, dtype=torch.bool)[None], normaliser=normaliser, ref_logprobs=ref,
            weights=weights[None], config=self.s.loss,
        )
        n = float(logps.numel())
        report = {"loss": _sum_count(loss, 1.0)}
        report.update({name: _sum_count(stats[name], 1.0) for name in ("policy_loss", "kl_loss")})
        report.update({name: _sum_count(stats[name], n) for name in AVERAGED if name in stats})
        return loss * scale, report
