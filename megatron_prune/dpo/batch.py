"""DPO microbatches: per-step pruning draws, the Full / Full-concat / shared layouts, scored positions.

Each pair is first *planned* for the step (sequence pruning truncates each response to a
sampled prefix, position pruning samples which response positions are scored, branch pruning
samples which branch keeps its backward); all draws are pure functions of (seed, step, sample
id). Plans are then laid out as rows: ``full`` puts every sequence in its own padded row,
``concat`` packs a pair's chosen and rejected sequences into one row as independent causal
segments with restarting position ids, ``shared`` puts the prompt once and both responses after
it, ``[prompt, chosen, rejected]``, each response a segment that sees the prompt as its prefix
and continues its position ids (rejected's ids restart at the prompt's end, as if it followed
the prompt). The scored positions become a
:class:`~megatron_prune.model.selective_gpt.TokenSelection`; a response's first token is
scored from the prompt's last position, its later tokens from their own previous position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_prune import sampling
from megatron_prune.config import PruneConfig
from megatron_prune.data.preference import PreferencePair
from megatron_prune.model.segments import Segment, SegmentLayout
from megatron_prune.model.selective_gpt import TokenSelection

CHOSEN, REJECTED = 0, 1
LAYOUTS = ("full", "concat", "shared")


@dataclass
class PlannedPair:
    """One preference pair as this step executes it."""

    sample_id: int
    """Dataset index (keys every draw)."""
    prompt: list[int]
    """Prompt token ids."""
    responses: tuple[list[int], list[int]]
    """Chosen and rejected token ids after sequence pruning."""
    full_lengths: tuple[int, int]
    """Response lengths before sequence pruning."""
    scored: tuple[torch.Tensor, torch.Tensor]
    """Scored positions (indices into each kept response) after position pruning."""
    kept_branch: int | None
    """Branch keeping its backward under branch pruning (CHOSEN/REJECTED), None without it."""


def plan_pair(pair: PreferencePair, *, sample_id: int, step: int, seed: int, prune: PruneConfig) -> PlannedPair:
    if not pair.prompt_ids:
        raise ValueError(f"{pair.source}:{pair.line}: empty prompt; the first response token cannot be scored")
    responses, scored, full = [], [], []
    for branch, ids in enumerate((pair.chosen_ids, pair.rejected_ids)):
        name = ("chosen", "rejected")[branch]
        kept = sampling.prefix_length(
            len(ids), min_ratio=prune.seq_min_ratio, seed=seed, step=step, sample_id=sample_id, what=f"prefix/{name}"
        )
        responses.append(list(ids[:kept]))
        full.append(len(ids))
        scored.append(
            sampling.position_subset(
                kept, ratio=prune.position_ratio, seed=seed, step=step, sample_id=sample_id, what=f"positions/{name}"
            )
        )
    kept_branch = None
    if prune.branch:
        keep_chosen = sampling.keep_chosen_branch(
            chosen_prob=prune.branch_chosen_prob, seed=seed, step=step, sample_id=sample_id
        )
        kept_branch = CHOSEN if keep_chosen else REJECTED
    return PlannedPair(sample_id, list(pair.prompt_ids), (responses[0], responses[1]), (full[0], full[1]),
                       (scored[0], scored[1]), kept_branch)


@dataclass(frozen=True)
class FlopWeights:
    """Forward FLOPs of the policy's parts, for choosing how a shared row runs a pruned branch."""

    body: float
    """One token through every layer's projections and MLP."""
    attention: float
    """One attended (query, key) pair in every layer."""
    head: float
    """One row through the LM head."""


def pruned_branch_joins_training_row(plan: PlannedPair, *, weights: FlopWeights) -> bool:
    """Under branch pruning in the shared layout: run the pruned branch inside the training row
    ``[prompt, kept, pruned]`` (its log-probs detached) rather than as its own no-grad row
    ``[prompt, pruned]``?

    Both are exact and both run the pruned response forward once; joining saves the second
    forward of the prompt but pays the pruned response's backward (2 x its forward, 3 x at the
    selective head, which recomputes its logits), so it is chosen when that is cheaper.
    """
    prompt, pruned = len(plan.prompt), len(plan.responses[1 - plan.kept_branch])
    scored = len(plan.scored[1 - plan.kept_branch])
    prompt_again = weights.body * prompt + weights.attention * prompt * (prompt + 1) / 2
    pruned_backward = 2 * (weights.body * pruned + weights.attention * pruned * (prompt + (pruned + 1) / 2)) \
        + 3 * weights.head * scored
    return pruned_backward < prompt_again


@dataclass
class Response:
    """One response's slice of a microbatch."""

    pair: int
    """Index of the pair within the microbatch."""
    branch: int
    """CHOSEN or REJECTED."""
    num_scored: int
    """Positions scored (after position pruning)."""
    length: int
    """Response tokens executed (after sequence pruning)."""


@dataclass
class DPOMicrobatch:
    """Tensors for one forward pass plus what the loss needs to reassemble responses."""

    tokens: torch.Tensor
    """[b, s] token ids (padding = pad id)."""
    position_ids: torch.Tensor
    """[b, s]: each token's position in its own sequence: restarting at 0 in every packed
    sequence (concat), ``P ... P+n-1`` for each response after a shared prompt of ``P`` tokens
    (shared). With ``segments`` set the model rotates every token by these ids (not by its row
    index), which the shared layout needs: rejected sits after chosen but rotates as if it
    followed the prompt."""
    attention_mask: torch.Tensor | None
    """Always None: attention follows ``segments`` (concat, shared) or is plain causal (full)."""
    segments: SegmentLayout | None
    """Which keys each query attends to: one causal segment per sequence (concat), or the prompt
    plus one segment per response with the prompt as its prefix (shared); None = plain causal
    rows (full)."""
    selection: TokenSelection
    """Scored positions; ``seq_ids`` index ``responses``."""
    labels: torch.Tensor
    """[b, s] next-token labels (for the full-logits baseline head)."""
    responses: list[Response]
    """Responses in this microbatch, in ``seq_ids`` order."""
    num_pairs: int
    """Pairs this microbatch's loss averages over."""
    executed_tokens: int
    """Non-padding tokens run through the model."""
    extras: dict = field(default_factory=dict)
    """Values the loss needs from earlier passes (reference log-probs, pruned-branch log-ratios)."""
    row_starts: list[int] | None = None
    """After :func:`pack_rows`: where each row of the unpacked layout starts in the one packed row."""
    padding_mask: torch.Tensor | None = None
    """[b, s] bool, True at padding (kept out of a mixture-of-experts model's router losses)."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_length(plans: list[PlannedPair], *, layout: str, branches: list[list[int]]) -> int:
    """Tokens of the longest row these plans need in ``layout`` (before padding)."""
    longest = 0
    for plan, bs in zip(plans, branches):
        lengths = [len(plan.prompt) + len(plan.responses[b]) for b in bs]
        if layout == "shared":
            longest = max(longest, len(plan.prompt) + sum(len(plan.responses[b]) for b in bs))
        else:
            longest = max(longest, sum(lengths) if layout == "concat" else max(lengths))
    return longest


def _shared_row(plan: PlannedPair, branches: list[int]) -> tuple[list[int], list[int], list[Segment], list[int]]:
    """Tokens, position ids, segments and each response's start of one ``[prompt, r1, r2, ...]`` row."""
    prompt = len(plan.prompt)
    tokens, positions, starts = list(plan.prompt), list(range(prompt)), []
    if len(branches) == 1:
        # A single response after the prompt is one plain causal sequence.
        starts.append(prompt)
        tokens += plan.responses[branches[0]]
        positions += range(prompt, len(tokens))
        return tokens, positions, [Segment(0, len(tokens))], starts
    segments = [Segment(0, prompt)]
    for b in branches:
        response = plan.responses[b]
        start = len(tokens)
        starts.append(start)
        tokens += response
        positions += range(prompt, prompt + len(response))
        if response:
            segments.append(Segment(start, start + len(response), 0, prompt))
    return tokens, positions, segments, starts


def build_microbatch(
    plans: list[PlannedPair],
    *,
    branches: list[list[int]],
    layout: str,
    seq_length: int,
    pad_id: int,
    num_rows: int | None = None,
) -> DPOMicrobatch:
    """Lay out ``branches[i]`` of ``plans[i]`` as rows of ``seq_length`` tokens.

    ``num_rows`` appends empty (all-padding) rows up to that many, so every microbatch of a
    pipeline-parallel pass has the same shape.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"DPO layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    rows: list[list[tuple[int, int]]] = []  # each row: (plan index, branch) sequences
    for i, bs in enumerate(branches):
        if layout in ("concat", "shared"):
            rows.append([(i, b) for b in bs])
        else:
            rows.extend([(i, b)] for b in bs)
    num_rows = max(num_rows or 0, len(rows))
    tokens = torch.full((num_rows, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((num_rows, seq_length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((num_rows, seq_length), dtype=torch.long)
    segment_rows: list[list[Segment]] = [[] for _ in range(num_rows)]
    index, label_ids, seq_ids, responses = [], [], [], []
    executed = 0
    used = [0] * num_rows  # tokens at the start of each row; the rest is padding
    untrained: list[tuple[int, int, int]] = []  # (row, start, end) of pruned responses in a training row
    for row, sequences in enumerate(rows):
        if layout == "shared":
            plan_i = sequences[0][0]
            plan = plans[plan_i]
            seq, pos, segment_rows[row], starts = _shared_row(plan, [b for _, b in sequences])
            assert len(seq) <= seq_length, "row longer than the step's sequence length"
            tokens[row, : len(seq)] = torch.tensor(seq)
            position_ids[row, : len(seq)] = torch.tensor(pos)
            for (_, branch), start in zip(sequences, starts):
                response = plan.responses[branch]
                # Token j of a response sits at start+j; j = 0 is predicted by the prompt's last
                # position, j >= 1 by the response's own previous position.
                if response:
                    labels[row, start : start + len(response) - 1] = torch.tensor(response[1:])
                scored = plan.scored[branch]
                positions = torch.where(scored == 0, len(plan.prompt) - 1, start + scored - 1)
                index.append(positions * num_rows + row)
                label_ids.append(torch.tensor(response, dtype=torch.long)[scored])
                seq_ids.append(torch.full((len(scored),), len(responses), dtype=torch.long))
                responses.append(Response(plan_i, branch, len(scored), len(response)))
                if plan.kept_branch is not None and branch != plan.kept_branch:
                    untrained.append((row, start, start + len(response)))
            # One label per position (the full-logits head, refused with this layout): the prompt's
            # last position gets the first response's first token.
            first = plan.responses[sequences[0][1]]
            labels[row, : len(plan.prompt) - 1] = torch.tensor(plan.prompt[1:], dtype=torch.long)
            labels[row, len(plan.prompt) - 1] = first[0] if first else pad_id
            executed += len(seq)
            used[row] = len(seq)
            continue
        start = 0
        for plan_i, branch in sequences:
            plan = plans[plan_i]
            seq = plan.prompt + plan.responses[branch]
            end = start + len(seq)
            assert end <= seq_length, "row longer than the step's sequence length"
            tokens[row, start:end] = torch.tensor(seq)
            labels[row, start : end - 1] = torch.tensor(seq[1:])
            position_ids[row, start:end] = torch.arange(len(seq))
            segment_rows[row].append(Segment(start, end))
            scored = plan.scored[branch]
            # Response token j sits at start+len(prompt)+j and is predicted by the previous position.
            positions = start + len(plan.prompt) + scored - 1
            index.append(positions * num_rows + row)
            label_ids.append(torch.tensor(plan.responses[branch], dtype=torch.long)[scored])
            seq_ids.append(torch.full((len(scored),), len(responses), dtype=torch.long))
            responses.append(Response(plan_i, branch, len(scored), len(plan.responses[branch])))
            executed += len(seq)
            start = end
        used[row] = start
    segments = None if layout == "full" else SegmentLayout(rows=segment_rows, seq_length=seq_length)
    selection = TokenSelection(index=torch.cat(index), labels=torch.cat(label_ids), seq_ids=torch.cat(seq_ids))
    padding_mask = _padding_after(used, seq_length)
    # A branch-pruned response run inside a training row (shared layout) only gives its log-probs,
    # like one run in its own forward-only pass: the router losses leave it out in both cases.
    for row, start, end in untrained:
        padding_mask[row, start:end] = True
    return DPOMicrobatch(tokens, position_ids, None, segments, selection, labels, responses, len(plans), executed,
                         padding_mask=padding_mask)


def _padding_after(used: list[int], seq_length: int) -> torch.Tensor:
    """[len(used), seq_length] bool: True from position ``used[r]`` of row ``r`` on."""
    return torch.arange(seq_length)[None, :] >= torch.tensor(used, dtype=torch.long)[:, None]


def pack_rows(batch: DPOMicrobatch, *, seq_length: int, pad_id: int) -> DPOMicrobatch:
    """``batch``'s rows laid end to end in one row of ``seq_length`` tokens, their padding dropped.

    Exact for the segment layouts (``concat``, ``shared``): a row's tokens keep their position ids
    and their segments (shifted with the row), so every token attends to the same keys and rotates
    by the same position as before, and the scored positions follow their tokens. Only the padding
    between rows goes (and the empty rows a pipeline-parallel pass adds); ``row_starts`` records
    where each row went.
    """
    if batch.segments is None:
        raise ValueError("only the concat and shared layouts can be packed (the full layout has no segments)")
    rows = batch.tokens.shape[0]
    used = [max((seg.end for seg in row), default=0) for row in batch.segments.rows]
    starts = [sum(used[:r]) for r in range(rows)]
    assert sum(used) <= seq_length, "packed row longer than its sequence length"
    tokens = torch.full((1, seq_length), pad_id, dtype=torch.long)
    labels = torch.full_like(tokens, pad_id)
    position_ids = torch.zeros_like(tokens)
    padding_mask = torch.ones((1, seq_length), dtype=torch.bool)
    segments = []
    for r, (start, n) in enumerate(zip(starts, used)):
        tokens[0, start : start + n] = batch.tokens[r, :n]
        padding_mask[0, start : start + n] = batch.padding_mask[r, :n] if batch.padding_mask is not None else False
        labels[0, start : start + n] = batch.labels[r, :n]
        position_ids[0, start : start + n] = batch.position_ids[r, :n]
        segments += [Segment(seg.start + start, seg.end + start,
                             seg.prefix_start + start if seg.prefix_length else 0,
                             seg.prefix_end + start if seg.prefix_length else 0) for seg in batch.segments.rows[r]]
    index = batch.selection.index
    selection = TokenSelection(index=index // rows + torch.tensor(starts, dtype=torch.long)[index % rows],
                               labels=batch.selection.labels,
                               seq_ids=batch.selection.seq_ids)
    return DPOMicrobatch(tokens, position_ids, None, SegmentLayout(rows=[segments], seq_length=seq_length),
                         selection, labels, batch.responses, batch.num_pairs, batch.executed_tokens,
                         dict(batch.extras), row_starts=starts, padding_mask=padding_mask)


def build_prefix_replay(
    plans: list[PlannedPair],
    *,
    branches: list[int],
    stored_rows: int,
    stored_length: int,
    pad_multiple: int,
    pad_id: int,
    prompt_starts: list[int] | None = None,
) -> DPOMicrobatch:
    """Response ``branches[i]`` of ``plans[i]`` as one row run over stored prompt keys and values.

    Plan ``i``'s prompt starts row ``i`` of a shared-layout forward of ``stored_rows`` rows of
    ``stored_length`` tokens (the training rows ``[prompt, kept]``), whose keys and values are laid
    end to end in front of this row (see
    :func:`~megatron_prune.model.segment_attention.attend_to_prefix_kv`). Each response is a segment
    of this row: its prompt's last token followed by the response without its last token, at
    positions ``P-1, P, ...``, with stored row ``i``'s first ``P-1`` keys as its prefix. Input ``j``
    predicts response token ``j``, so every scored position (the first one too) is scored here.
    The segments are packed one after another: no padding but the row's tail. ``prompt_starts``
    gives where plan ``i``'s prompt starts among the stored positions when the stored forward
    was packed (:func:`pack_rows`); by default, at the start of row ``i``.
    """
    stored = stored_rows * stored_length
    total = sum(len(plan.responses[b]) for plan, b in zip(plans, branches))
    seq_length = round_up(max(total, 1), pad_multiple)
    tokens = torch.full((1, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((1, seq_length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((1, seq_length), dtype=torch.long)
    segments: list[Segment] = []
    index, label_ids, seq_ids, responses = [], [], [], []
    start = 0
    for row, (plan, branch) in enumerate(zip(plans, branches)):
        response, prompt = plan.responses[branch], len(plan.prompt)
        length = len(response)
        if length:
            tokens[0, start : start + length] = torch.tensor(plan.prompt[-1:] + response[:-1])
            labels[0, start : start + length] = torch.tensor(response)
            position_ids[0, start : start + length] = torch.arange(prompt - 1, prompt - 1 + length)
            first_key = row * stored_length if prompt_starts is None else prompt_starts[row]
            segments.append(Segment(stored + start, stored + start + length, first_key, first_key + prompt - 1))
        scored = plan.scored[branch]
        index.append(start + scored)
        label_ids.append(torch.tensor(response, dtype=torch.long)[scored])
        seq_ids.append(torch.full((len(scored),), len(responses), dtype=torch.long))
        responses.append(Response(row, branch, len(scored), length))
        start += length
    layout = SegmentLayout(rows=[segments], seq_length=stored + seq_length)
    selection = TokenSelection(index=torch.cat(index), labels=torch.cat(label_ids), seq_ids=torch.cat(seq_ids))
    return DPOMicrobatch(tokens, position_ids, None, layout, selection, labels, responses, len(plans), total)
