"""One DPO step on Megatron's schedules: reference pass, pruned-branch pass, training pass.

Execution order follows the prunings: sequence pruning shapes every pass (the schedule is
called with the step's truncated ``seq_length``, so every stage and p2p buffer shrinks), branch
pruning splits the policy into a forward-only pass over the pruned branches and a
forward-backward pass over the kept ones, and position pruning picks the positions the
selective head scores. In the shared layout (``[prompt, chosen, rejected]`` rows) the reference
pass always runs both responses on one prompt; under branch pruning the pruned responses run
without gradients on the prompt keys and values their training microbatch ``[prompt, kept]``
computed (one packed row per microbatch, inside its forward step on every pipeline stage);
where that is not possible (a layer without segment attention), each pair's pruned response
either joins its training row ``[prompt, kept, pruned]`` with its log-probs detached, or runs as
its own no-grad row ``[prompt, pruned]``, whichever the FLOP count says is cheaper for that pair
(joining saves a second forward of the prompt and pays the pruned response's backward).
Forward-only passes run under ``no_grad`` through Megatron's own forward-only schedule, so no
pipeline stage runs a backward for them. The pruned responses stand in for what the training
pass would score, so LoRA adapter dropout acts in them, whichever way they run.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_prune.config import DPOConfig, PruneConfig
from megatron_prune.data.preference import PreferencePair
from megatron_prune.dpo.batch import (
    CHOSEN,
    REJECTED,
    DPOMicrobatch,
    FlopWeights,
    PlannedPair,
    build_microbatch,
    build_prefix_replay,
    pack_rows,
    plan_pair,
    pruned_branch_joins_training_row,
    round_up,
    row_length,
)
from megatron_prune.dpo.loss import dpo_pair_losses, response_log_ratios
from megatron_prune.model.lora import adapter_dropout_as
from megatron_prune.model.segment_attention import PrefixKV, attend_to_prefix_kv, capture_prefix_kv
from megatron_prune.training.step import run_schedule

METRICS = ("loss", "reward_accuracy", "margin", "chosen_reward", "rejected_reward")


@dataclass(kw_only=True)
class DPOStepSettings:
    """Fixed settings of the DPO step."""

    dpo: DPOConfig
    """Objective, layout and reference mode."""
    prune: PruneConfig
    """Pruning knobs."""
    seed: int
    """Seed of every pruning draw."""
    micro_batch_size: int
    """Pairs per microbatch."""
    pad_id: int
    """Token id used for padding."""
    pad_multiple: int = 8
    """Row length is padded to a multiple of this (and of TP under sequence parallelism)."""
    pruned_branch_on_prefix_kv: bool = True
    """Shared layout under branch pruning: run each pruned response on the training pass's prompt
    keys and values where the model allows it (segment attention in every layer); False
    always picks between a separate ``[prompt, pruned]`` row and joining the training row."""


def _flop_weights(chunk: torch.nn.Module) -> FlopWeights:
    """Forward FLOPs per body token, attended pair and head row of the whole model (all stages)."""
    from megatron.core.utils import get_model_config

    cfg = get_model_config(chunk)
    model = chunk
    while hasattr(model, "module"):
        model = model.module
    q = cfg.num_attention_heads * cfg.kv_channels
    kv = (cfg.num_query_groups or cfg.num_attention_heads) * cfg.kv_channels
    matrices = 3 if cfg.gated_linear_unit else 2
    mlp = [matrices * cfg.hidden_size * cfg.ffn_hidden_size] * cfg.num_layers
    if cfg.num_moe_experts:  # a MoE layer's active weights: the router and the top-k experts
        freq = cfg.moe_layer_freq
        pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(cfg.num_layers)]
        moe = cfg.hidden_size * (cfg.num_moe_experts + cfg.moe_router_topk * matrices * cfg.moe_ffn_hidden_size)
        mlp = [moe if sparse else dense for sparse, dense in zip(pattern, mlp)]
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    return FlopWeights(body=2.0 * (attention * cfg.num_layers + sum(mlp)), attention=4.0 * q * cfg.num_layers,
                       head=2.0 * cfg.hidden_size * getattr(model, "vocab_size", cfg.hidden_size))


def _sum_count(values: torch.Tensor) -> torch.Tensor:
    total = values.detach().float().sum()
    return torch.stack([total, total.new_tensor(float(values.numel()))])


def policy_forward_step(data_iterator: Iterator, model, *, selective_head: bool):
    """Megatron forward step: run the model on a DPOMicrobatch; the loss sees per-token log-probs."""
    batch: DPOMicrobatch = next(data_iterator)
    selection = batch.selection
    if not selective_head:
        selection = type(selection)(selection.index, selection.labels, selection.seq_ids, all_labels=batch.labels)
    extra = {} if batch.segments is None else {"segments": batch.segments}
    if batch.padding_mask is not None:
        extra["padding_mask"] = batch.padding_mask
    replay = batch.extras.get("replay")
    if replay is None:
        output = model(batch.tokens, batch.position_ids, batch.attention_mask, token_selection=selection, **extra)
    else:
        output = _forward_with_replay(model, batch, replay, selection, extra)
    return output, partial(batch.extras["loss_func"], batch)


def _forward_with_replay(model, batch: DPOMicrobatch, replay: DPOMicrobatch, selection, extra: dict):
    """The training rows, then the pruned responses on the keys and values they computed for the prompts.

    Under pipeline parallelism the two forwards run the same layers on each stage: the pruned
    responses' hidden states ride to the next stage in ``replay_rows`` extra rows of the tensor the
    schedule sends (:func:`_carry`), detached, so their gradient is zero and the stage before
    runs no backward for them. The last stage keeps their log-probs for the loss.
    """
    gpt = model
    while hasattr(gpt, "module"):
        gpt = gpt.module
    rows, carried = batch.tokens.shape[0], batch.extras.get("replay_rows", 0)
    received = None if gpt.pre_process or not carried else gpt.decoder.input_tensor
    if received is not None:
        gpt.set_input_tensor(received[:, :rows])
    store = PrefixKV()
    training = torch.is_grad_enabled()
    with capture_prefix_kv(store):
        output = model(batch.tokens, batch.position_ids, batch.attention_mask, token_selection=selection, **extra)
    if received is not None:  # the received part of the pruned responses' hidden states
        local = replay.tokens.shape[1] * received.shape[0] // batch.tokens.shape[1]  # sequence-parallel shard
        gpt.set_input_tensor(_uncarry(received[:, rows:], local))
    with attend_to_prefix_kv(store), adapter_dropout_as(training), \
            torch.profiler.record_function("dpo:pruned_on_prefix_kv"):
        replayed = model(replay.tokens, replay.position_ids, None, token_selection=replay.selection,
                         segments=replay.segments)
    if gpt.post_process:
        batch.extras["replay_logps"] = replayed.float()
        return output
    assert carried, "pruned responses on stored keys across pipeline stages need replay_rows"
    return torch.cat([output, _carry(replayed, carried, output.shape[0])], dim=1)


def _carry(hidden: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """One row's hidden states ``[n, 1, h]`` (n ≤ rows·length) as ``[length, rows, h]``: consecutive
    pieces of ``length`` positions side by side, zero-padded, the shape of extra microbatch rows."""
    n, _, h = hidden.shape
    assert n <= rows * length, f"{n} pruned-response positions do not fit {rows} rows of {length}"
    padded = hidden.new_zeros(rows * length, h)
    padded[:n] = hidden[:, 0]
    return padded.view(rows, length, h).transpose(0, 1)


def _uncarry(part: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_carry`: ``[length, rows, h]`` back to the row's first ``n`` positions ``[n, 1, h]``."""
    length, rows, h = part.shape
    return part.transpose(0, 1).reshape(rows * length, 1, h)[:n]


def collect_logps(batch: DPOMicrobatch, logps: torch.Tensor):
    """Forward-only loss function: hand back the per-token log-probs."""
    return torch.zeros((), device=logps.device), {"logps": logps.detach().float().cpu()}


def split_by_response(batch: DPOMicrobatch, logps: torch.Tensor) -> list[torch.Tensor]:
    counts = [r.num_scored for r in batch.responses]
    return list(torch.split(logps, counts))


class DPOStep:
    """Builds and runs the passes of one DPO step for this data-parallel rank."""

    def __init__(
        self,
        *,
        settings: DPOStepSettings,
        policy: list[torch.nn.Module],
        reference: list[torch.nn.Module] | None,
        ref_lookup: Callable[[int, int], torch.Tensor] | None = None,
    ) -> None:
        if reference is None and ref_lookup is None:
            raise ValueError("DPO needs an online reference model or precomputed reference log-probs")
        if settings.dpo.layout == "shared" and not settings.prune.selective_head:
            raise ValueError("--dpo-layout shared needs the selective head: both responses' first tokens are "
                             "scored from the prompt's last position, and the full-logits head has one label per "
                             "position; drop --no-selective-head or use --dpo-layout concat")
        self.s = settings
        self.policy = policy
        self.reference = reference
        self.ref_lookup = ref_lookup
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.pad_multiple = math.lcm(settings.pad_multiple, tp)
        self.flop_weights = _flop_weights(policy[0])
        self._segment_layers: bool | None = None  # every layer of every stage runs segment attention
        self.reset_counters()

    def reset_counters(self) -> None:
        self.counters = {k: 0 for k in ("policy_tokens", "ref_tokens", "policy_padded_tokens", "ref_padded_tokens",
                                        "scored_positions", "logits_rows", "train_tokens", "forward_only_tokens")}

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, step: int, samples: list[tuple[int, PreferencePair]]) -> list[PlannedPair]:
        return [plan_pair(pair, sample_id=sid, step=step, seed=self.s.seed, prune=self.s.prune) for sid, pair in samples]

    def _groups(self, plans: list[PlannedPair], branches_of: Callable[[PlannedPair], list[int]], *,
                pairs: int | None = None):
        """Pairs of each microbatch of one pass (``pairs`` each, default ``micro_batch_size``).

        Padded rows: pairs are grouped by the length of their rows in this pass, longest first, so
        each microbatch pads to rows of similar length. Packed rows (``--dpo-pack-rows``) have no
        padding between pairs to save; there the pairs are spread to balance the microbatches'
        tokens instead (longest first, each to the microbatch with the fewest tokens that still has
        room), because the largest packed row sets the pass's peak activations and, under PP, the
        length of every microbatch. Either way every microbatch holds ``micro_batch_size`` pairs
        (the last one the remainder), so the step's loss (the mean of the microbatch means) is the
        same mean over pairs.
        """
        layout = self.s.dpo.layout
        length = {id(p): row_length([p], layout=layout, branches=[branches_of(p)]) for p in plans}
        order = sorted(plans, key=lambda p: -length[id(p)])
        mbs = pairs or self.s.micro_batch_size
        if not self.s.dpo.pack_rows:
            return [order[i : i + mbs] for i in range(0, len(order), mbs)]
        sizes = [min(mbs, len(order) - i) for i in range(0, len(order), mbs)]
        groups: list[list[PlannedPair]] = [[] for _ in sizes]
        tokens = [0] * len(sizes)
        for p in order:
            k = min((k for k in range(len(sizes)) if len(groups[k]) < sizes[k]), key=lambda k: tokens[k])
            groups[k].append(p)
            tokens[k] += length[id(p)]
        return groups

    def _microbatches(self, plans: list[PlannedPair], branches_of: Callable[[PlannedPair], list[int]], *,
                      full_rows: bool = False, pairs: int | None = None):
        """Microbatches of one pass, their pairs, and the ``seq_length`` the schedule is called with.

        Without pipeline parallelism each microbatch is padded only to its own longest row; under
        PP every microbatch of a pass shares one length (the p2p buffers are shaped from it), the
        pass's longest row — so sequence pruning shrinks every stage and every p2p buffer.
        ``full_rows`` pads a short last microbatch with empty rows (a pass over a subset of the
        pairs under PP, whose p2p buffers are shaped for ``micro_batch_size`` rows). With
        ``--dpo-pack-rows`` each microbatch then becomes one row of its tokens (:func:`pack_rows`),
        padded only to the length multiple (under PP: to the pass's longest packed row).
        """
        groups = self._groups(plans, branches_of, pairs=pairs)
        branches = [[branches_of(p) for p in g] for g in groups]
        layout = self.s.dpo.layout
        lengths = [round_up(row_length(g, layout=layout, branches=b), self.pad_multiple)
                   for g, b in zip(groups, branches)]
        seq_length = max(lengths)
        num_rows = None
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            lengths = [seq_length] * len(lengths)
            if full_rows:
                num_rows = max(len(g) if layout != "full" else sum(map(len, b)) for g, b in zip(groups, branches))
        batches = [
            build_microbatch(g, branches=b, layout=layout, seq_length=n, pad_id=self.s.pad_id, num_rows=num_rows)
            for g, b, n in zip(groups, branches, lengths)
        ]
        if self.s.dpo.pack_rows:
            lengths = [round_up(max(b.executed_tokens, 1), self.pad_multiple) for b in batches]
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                lengths = [max(lengths)] * len(lengths)
            batches = [pack_rows(b, seq_length=n, pad_id=self.s.pad_id) for b, n in zip(batches, lengths)]
            seq_length = max(lengths)
        return batches, seq_length, groups

    # -- passes -----------------------------------------------------------------------------------
    def _forward_only(self, model, batches: list[DPOMicrobatch], seq_length: int) -> list[torch.Tensor] | None:
        """Per-microbatch log-probs of the scored positions (last stage), or None elsewhere."""
        for b in batches:
            b.extras["loss_func"] = collect_logps
        with torch.no_grad():
            outputs = run_schedule(
                forward_step_func=partial(policy_forward_step, selective_head=self.s.prune.selective_head),
                data_iterator=self._iterators(model, batches),
                model=model,
                num_microbatches=len(batches),
                seq_length=seq_length,
                micro_batch_size=batches[0].tokens.shape[0],
                forward_only=True,
            )
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        return [o["logps"] for o in outputs]

    @staticmethod
    def _iterators(model, batches):
        return [iter(batches) for _ in model] if len(model) > 1 else iter(batches)

    def reference_logps(self, plans: list[PlannedPair]) -> dict[tuple[int, int], torch.Tensor] | None:
        """Reference log-probs of every scored position, keyed by (sample id, branch)."""
        if self.reference is None:
            return {
                (p.sample_id, b): self.ref_lookup(p.sample_id, b)[p.scored[b]] for p in plans for b in (CHOSEN, REJECTED)
            }
        batches, seq_length, groups = self._microbatches(plans, lambda p: [CHOSEN, REJECTED])
        outputs = self._forward_only(self.reference, batches, seq_length)
        self.counters["ref_tokens"] += sum(b.executed_tokens for b in batches)
        self.counters["forward_only_tokens"] += sum(b.executed_tokens for b in batches)
        self.counters["ref_padded_tokens"] += sum(b.tokens.numel() for b in batches)
        if outputs is None:
            return None
        return self._by_response(groups, batches, outputs)

    @staticmethod
    def _by_response(groups, batches, outputs) -> dict[tuple[int, int], torch.Tensor]:
        found = {}
        for batch, logps, group in zip(batches, outputs, groups):
            for resp, values in zip(batch.responses, split_by_response(batch, logps)):
                found[(group[resp.pair].sample_id, resp.branch)] = values
        return found

    def run(
        self, step: int, samples: list[tuple[int, PreferencePair]], *, forward_only: bool = False
    ) -> tuple[list[dict], dict[str, float]]:
        """Accumulate this step's gradients (or only evaluate). Returns loss outputs and token counters."""
        self.reset_counters()
        plans = self.plan(step, samples)
        ref = self.reference_logps(plans)
        pruned_ratio = None
        joined: set[int] = set()  # sample ids whose pruned branch runs inside the training row
        replay = self.s.prune.branch and self._replays_pruned_branch()
        if self.s.prune.branch:
            if not replay and self.s.dpo.layout == "shared":
                joined = self._joined(plans)
            separate = [] if replay else [p for p in plans if p.sample_id not in joined]
            pruned_ratio = {}
        if self.s.prune.branch and separate:
            pruned_batches, pruned_len, pruned_groups = self._microbatches(
                separate, lambda p: [1 - p.kept_branch], full_rows=bool(joined), pairs=self._pruned_pass_pairs(len(separate)))
            with adapter_dropout_as(not forward_only):  # the values the full step's training pass scores
                outputs = self._forward_only(self.policy, pruned_batches, pruned_len)
            self._count_policy(pruned_batches, backward=False)
            if outputs is not None:
                pruned_logps = self._by_response(pruned_groups, pruned_batches, outputs)
                pruned_ratio = {
                    key: response_log_ratios(
                        val, ref[key], seq_ids=torch.zeros(len(val), dtype=torch.long),
                        num_scored=[len(val)], lengths=[self._length(plans, key)], reduction=self.s.dpo.loss_average,
                    )[0]
                    for key, val in pruned_logps.items()
                }

        def branches_of(p: PlannedPair) -> list[int]:
            if not self.s.prune.branch:
                return [CHOSEN, REJECTED]
            return [p.kept_branch, 1 - p.kept_branch] if p.sample_id in joined else [p.kept_branch]

        batches, seq_length, groups = self._microbatches(plans, branches_of)
        self._count_policy(batches, backward=not forward_only)
        for batch, group in zip(batches, groups):
            batch.extras["loss_func"] = partial(self._loss, group=group, ref=ref, pruned_ratio=pruned_ratio)
        carried = 0  # extra rows of the p2p tensor that carry the pruned responses between stages
        if replay:
            replays = self._prefix_replays(batches, groups)
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                carried = max(-(-r.tokens.shape[1] // b.tokens.shape[1]) for b, r in zip(batches, replays))
            for batch, replayed in zip(batches, replays):
                batch.extras["replay"] = replayed
                batch.extras["replay_rows"] = carried
            self._count_policy(replays, backward=False)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            outputs = run_schedule(
                forward_step_func=partial(policy_forward_step, selective_head=self.s.prune.selective_head),
                data_iterator=self._iterators(self.policy, batches),
                model=self.policy,
                num_microbatches=len(batches),
                seq_length=seq_length,
                micro_batch_size=batches[0].tokens.shape[0] + carried,
                forward_only=forward_only,
            )
        if not forward_only:  # a MoE policy's router losses: added in this training pass only
            from megatron_prune.model.moe import add_router_losses

            add_router_losses(outputs, self.policy, num_microbatches=len(batches))
        return outputs, self._reduced_counters()

    def _joined(self, plans: list[PlannedPair]) -> set[int]:
        """Sample ids whose pruned branch runs inside the training row (shared layout), the cheaper
        choice per pair (:func:`pruned_branch_joins_training_row`).

        The interleaved schedule needs the same microbatch count in every pass (a multiple of the
        stages), and expert-parallel peers must run the same passes with the same microbatch counts
        (they meet in every MoE layer's all-to-all): there one choice holds for the whole step, the
        majority's — under expert parallelism the majority over every data-parallel rank.
        """
        joined = {p.sample_id for p in plans if pruned_branch_joins_training_row(p, weights=self.flop_weights)}
        expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
        if (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) == 1 and not expert_parallel:
            return joined
        votes = torch.tensor([len(joined), len(plans)], dtype=torch.float64)
        if expert_parallel:
            dist.all_reduce(votes, group=parallel_state.get_data_parallel_group())
        return {p.sample_id for p in plans} if votes[1] and 2 * votes[0] >= votes[1] else set()

    def _pruned_pass_pairs(self, num_pairs: int) -> int:
        """Pairs per microbatch of the pruned branch's own forward-only pass.

        In the concat and full layouts a reference microbatch holds both responses of
        ``micro_batch_size`` pairs; the pruned pass holds one response per pair, so twice the
        pairs give it the same tokens per microbatch and half the forward calls (each call costs a
        fixed few milliseconds of Python besides its compute). The grouping changes no value: this
        pass only looks up log-probs per response. It stays ``micro_batch_size`` in the shared
        layout (its ``[prompt, pruned]`` rows already hold one response per pair in every pass),
        under the interleaved pipeline schedule (its microbatch count must stay a multiple of the
        stages), and under pipeline parallelism unless every microbatch gets the same rows (the
        p2p buffers are shaped once for the pass).
        """
        mbs = self.s.micro_batch_size
        if self.s.dpo.layout == "shared" or (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
            return mbs
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 and num_pairs % (2 * mbs):
            return mbs
        return 2 * mbs

    def _replays_pruned_branch(self) -> bool:
        """Whether pruned responses run on the training pass's prompt keys and values.

        In the shared layout this is the cheapest exact scheme: the pruned response runs forward
        once, without gradients and without its prompt (which the training row computes anyway);
        the other two (joining the training row, or a separate ``[prompt, pruned]`` row) pay the
        pruned response's backward or a second forward of the prompt. It needs segment attention
        in every layer of every stage (one vote over the pipeline, so that all stages agree);
        otherwise the cheaper of the other two is chosen per pair.
        """
        if self.s.dpo.layout != "shared" or not self.s.pruned_branch_on_prefix_kv:
            return False
        if self._segment_layers is None:
            cores = []
            for chunk in self.policy:
                while hasattr(chunk, "module"):
                    chunk = chunk.module
                cores += getattr(chunk, "_core_attentions", lambda: [None])()
            from megatron_prune.model.segment_attention import SegmentAttentionMixin

            votes = torch.tensor([sum(not isinstance(c, SegmentAttentionMixin) for c in cores), len(cores)])
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                dist.all_reduce(votes, group=parallel_state.get_pipeline_model_parallel_group())
            self._segment_layers = bool(votes[0] == 0 and votes[1] > 0)
        return self._segment_layers

    def _prefix_replays(self, batches: list[DPOMicrobatch], groups) -> list[DPOMicrobatch]:
        """Each training microbatch's pruned responses, laid out to run on its prompts' keys and values."""
        return [
            build_prefix_replay(group, branches=[1 - p.kept_branch for p in group], stored_rows=batch.tokens.shape[0],
                                stored_length=batch.tokens.shape[1], pad_multiple=self.pad_multiple,
                                pad_id=self.s.pad_id, prompt_starts=batch.row_starts)
            for batch, group in zip(batches, groups)
        ]

    @staticmethod
    def _length(plans, key) -> int:
        for p in plans:
            if p.sample_id == key[0]:
                return len(p.responses[key[1]])
        raise KeyError(key)

    def _count_policy(self, batches: list[DPOMicrobatch], *, backward: bool) -> None:
        """Token counters of one policy pass: ``policy_tokens`` counts every policy forward,
        ``train_tokens`` the passes that run a backward, ``forward_only_tokens`` the others (and,
        in :meth:`reference_logps`, the reference model's)."""
        executed = sum(b.executed_tokens for b in batches)
        self.counters["train_tokens" if backward else "forward_only_tokens"] += executed
        self.counters["policy_tokens"] += executed
        self.counters["policy_padded_tokens"] += sum(b.tokens.numel() for b in batches)
        n = sum(len(b.selection.index) for b in batches)
        self.counters["scored_positions"] += n
        self.counters["logits_rows"] += n if self.s.prune.selective_head else sum(b.tokens.numel() for b in batches)

    def _reduced_counters(self) -> dict[str, float]:
        names = sorted(self.counters)
        totals = torch.tensor([float(self.counters[n]) for n in names], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return {n: float(v) for n, v in zip(names, totals)}

    # -- loss -------------------------------------------------------------------------------------
    def _replay_ratios(self, replay: DPOMicrobatch, logps: torch.Tensor, group, ref) -> dict:
        """Log-ratios of the pruned responses run on the prompts' stored keys and values (constants)."""
        keys = [(group[r.pair].sample_id, r.branch) for r in replay.responses]
        ref_logps = torch.cat([ref[key] for key in keys]).to(logps.device)
        ratios = response_log_ratios(
            logps.detach(), ref_logps, seq_ids=replay.selection.seq_ids.to(logps.device),
            num_scored=[r.num_scored for r in replay.responses], lengths=[r.length for r in replay.responses],
            reduction=self.s.dpo.loss_average,
        )
        return dict(zip(keys, ratios))

    def _loss(self, batch: DPOMicrobatch, logps: torch.Tensor, *, group, ref, pruned_ratio):
        ref_logps = torch.cat(
            [ref[(group[r.pair].sample_id, r.branch)] for r in batch.responses]
        ).to(logps.device)
        ratios = response_log_ratios(
            logps, ref_logps, seq_ids=batch.selection.seq_ids.to(logps.device),
            num_scored=[r.num_scored for r in batch.responses], lengths=[r.length for r in batch.responses],
            reduction=self.s.dpo.loss_average,
        )
        chosen = [None] * len(group)
        rejected = [None] * len(group)
        for resp, value in zip(batch.responses, ratios):
            if self.s.prune.branch and resp.branch != group[resp.pair].kept_branch:
                value = value.detach()  # a pruned response run inside the training row: a constant
            (chosen if resp.branch == CHOSEN else rejected)[resp.pair] = value
        replay = batch.extras.get("replay")
        if replay is not None:
            pruned_ratio = {**pruned_ratio, **self._replay_ratios(replay, batch.extras["replay_logps"], group, ref)}
        grad_scale = None
        if self.s.prune.branch:
            q_w = self.s.prune.branch_chosen_prob
            scales = []
            for i, plan in enumerate(group):
                pruned = 1 - plan.kept_branch
                if (plan.sample_id, pruned) in pruned_ratio:
                    value = pruned_ratio[(plan.sample_id, pruned)].to(ratios.device)
                    (chosen if pruned == CHOSEN else rejected)[i] = value
                scales.append(1.0 / (q_w if plan.kept_branch == CHOSEN else 1.0 - q_w))
            grad_scale = torch.tensor(scales, device=ratios.device)
        losses, stats = dpo_pair_losses(torch.stack(chosen), torch.stack(rejected), beta=self.s.dpo.beta,
                                        grad_scale=grad_scale)
        loss = losses.mean()
        report = {"loss": _sum_count(losses)}
        report.update({name: _sum_count(v) for name, v in stats.items()})
        return loss, report
