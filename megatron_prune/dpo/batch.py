"""DPO microbatches: per-step pruning draws, the Full / Full-concat layouts, scored positions.

Each pair is first *planned* for the step (sequence pruning truncates each response to a
sampled prefix, position pruning samples which response positions are scored, branch pruning
samples which branch keeps its backward); all draws are pure functions of (seed, step, sample
id). Plans are then laid out as rows: ``full`` puts every sequence in its own padded row,
``concat`` packs a pair's chosen and rejected sequences into one row with a block-diagonal
causal mask and restarting position ids. The scored positions become a
:class:`~megatron_prune.model.selective_gpt.TokenSelection`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_prune import sampling
from megatron_prune.config import PruneConfig
from megatron_prune.data.preference import PreferencePair
from megatron_prune.model.selective_gpt import TokenSelection

CHOSEN, REJECTED = 0, 1


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
    """[b, s]: restarting at 0 in every packed sequence. Megatron-Core's rotary embedding on the
    local layer spec takes positions from the row index and ignores these; that is exact here
    because every sequence sits in its own block-diagonal segment and RoPE is relative within
    it. A layout that puts a token at a position other than its row offset (a shared prompt)
    needs per-token rotary positions passed through a seam, and a test that fails without them."""
    attention_mask: torch.Tensor | None
    """[b, 1, s, s] bool, True = masked (concat layout); None = plain causal."""
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


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_length(plans: list[PlannedPair], *, layout: str, branches: list[list[int]]) -> int:
    """Tokens of the longest row these plans need in ``layout`` (before padding)."""
    longest = 0
    for plan, bs in zip(plans, branches):
        lengths = [len(plan.prompt) + len(plan.responses[b]) for b in bs]
        longest = max(longest, sum(lengths) if layout == "concat" else max(lengths))
    return longest


def build_microbatch(
    plans: list[PlannedPair],
    *,
    branches: list[list[int]],
    layout: str,
    seq_length: int,
    pad_id: int,
) -> DPOMicrobatch:
    """Lay out ``branches[i]`` of ``plans[i]`` as rows of ``seq_length`` tokens."""
    rows: list[list[tuple[int, int]]] = []  # each row: (plan index, branch) sequences
    for i, bs in enumerate(branches):
        if layout == "concat":
            rows.append([(i, b) for b in bs])
        else:
            rows.extend([(i, b)] for b in bs)
    num_rows = len(rows)
    tokens = torch.full((num_rows, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((num_rows, seq_length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((num_rows, seq_length), dtype=torch.long)
    mask = torch.ones((num_rows, 1, seq_length, seq_length), dtype=torch.bool) if layout == "concat" else None
    index, label_ids, seq_ids, responses = [], [], [], []
    executed = 0
    for row, sequences in enumerate(rows):
        start = 0
        for plan_i, branch in sequences:
            plan = plans[plan_i]
            seq = plan.prompt + plan.responses[branch]
            end = start + len(seq)
            assert end <= seq_length, "row longer than the step's sequence length"
            tokens[row, start:end] = torch.tensor(seq)
            labels[row, start : end - 1] = torch.tensor(seq[1:])
            position_ids[row, start:end] = torch.arange(len(seq))
            if mask is not None:
                mask[row, 0, start:end, start:end] = ~torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
            scored = plan.scored[branch]
            # Response token j sits at start+len(prompt)+j and is predicted by the previous position.
            positions = start + len(plan.prompt) + scored - 1
            index.append(positions * num_rows + row)
            label_ids.append(torch.tensor(plan.responses[branch], dtype=torch.long)[scored])
            seq_ids.append(torch.full((len(scored),), len(responses), dtype=torch.long))
            responses.append(Response(plan_i, branch, len(scored), len(plan.responses[branch])))
            executed += len(seq)
            start = end
        if mask is not None and start < seq_length:
            pad = seq_length - start
            mask[row, 0, start:, start:] = ~torch.ones(pad, pad, dtype=torch.bool).tril()
    selection = TokenSelection(index=torch.cat(index), labels=torch.cat(label_ids), seq_ids=torch.cat(seq_ids))
    return DPOMicrobatch(tokens, position_ids, mask, selection, labels, responses, len(plans), executed)
