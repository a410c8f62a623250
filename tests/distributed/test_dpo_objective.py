"""The DPO objective as ``DPOStep`` computes it, against an independent plain-PyTorch reference.

- Pruning off: loss and every gradient equal the reference (``dpo_reference``) in every layout
  (full, concat, shared), both reductions, micro-batch 1 and 2.
- Sequence pruning (a forced draw) equals the reference DPO on the kept prefixes, both layouts
  and both reductions.
- Estimators through the real step: branch pruning's gradient, enumerated over every kept-branch
  pattern with the real ``plan()`` and weighted by each pattern's probability, equals the
  unpruned gradient (q = 0.3 and 0.5), in the concat layout and in the shared layout (with the
  pruned responses on the training pass's prompt keys and values; and with some pairs running
  their pruned branch inside the training row and some in their own pass); position pruning's
  reward estimate, enumerated over the
  position subsets the trainer scores, equals the full-response log-ratio. Draws are controlled
  only at the draw functions of ``megatron_prune.sampling``.
- Draw frequencies: the branch draw keeps chosen at rate q; the position draw keeps
  round(α·T) positions, each with frequency α.
- Compute savings as structure: under branch pruning the forward-only passes build no autograd
  graph and save no tensors, the schedule runs one backward per training microbatch, and the
  training pass holds exactly the kept branches' tokens (one rank and PP = 2).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import pytest
import torch

from tests.dist import run_distributed
from tests.distributed import dpo_reference as R
from tests.distributed.dpo_harness import SEED, sample_pairs

BETA = 0.7
PRUNE_OFF = dict(position_ratio=1.0, seq_min_ratio=1.0, branch=False, branch_chosen_prob=0.5, selective_head=True)
REFERENCE_CASES = [
    dict(layout=layout, reduction=reduction, micro_batch_size=mbs)
    for layout in ("full", "concat", "shared") for reduction in ("mean", "sum") for mbs in (1, 2)
] + [dict(layout="concat", reduction="mean", micro_batch_size=2, selective_head=False)] + [
    dict(layout=layout, reduction="mean", micro_batch_size=2, pack_rows=True, selective_head=head)
    for layout, head in (("concat", True), ("concat", False), ("shared", True))
]
ENUM_PAIRS = 4  # 2**4 branch patterns per q


# -- worker helpers (run inside run_distributed) ---------------------------------------------------
def _models(parallel: dict | None = None, preset: str = "tiny"):
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model

    arch = get_preset(preset)
    par = ParallelConfig(**(parallel or {}))
    policy = setup_model(arch, par, seed=SEED)
    reference = setup_model(arch, par, seed=SEED + 1, trainable=False)  # a different model: margins are not 0
    return arch, policy, reference


def _runner(policy, reference, *, layout="concat", reduction="mean", micro_batch_size=2, prefix_kv=True,
            pack_rows=False, **prune):
    from megatron_prune.config import DPOConfig, PruneConfig
    from megatron_prune.dpo.step import DPOStep, DPOStepSettings

    _, pad_id = sample_pairs()
    settings = DPOStepSettings(
        dpo=DPOConfig(layout=layout, loss_average=reduction, beta=BETA, pack_rows=pack_rows),
        prune=PruneConfig(**{**PRUNE_OFF, **prune}), seed=SEED, micro_batch_size=micro_batch_size, pad_id=pad_id,
        pruned_branch_on_prefix_kv=prefix_kv,
    )
    return DPOStep(settings=settings, policy=policy, reference=reference)


def _step(runner, policy, samples, *, step=0, forward_only=False) -> dict:
    """One DPO step's loss and accumulated gradients ({parameter name: grad}, single rank)."""
    from megatron_prune.training.step import reduce_metrics
    from tests.distributed.dpo_reference import main_grads

    for chunk in policy:
        chunk.zero_grad_buffer()
    outputs, _ = runner.run(step, samples, forward_only=forward_only)
    metrics = reduce_metrics(outputs)
    return dict(loss=metrics["loss"], grads=None if forward_only else main_grads(policy[0]), metrics=metrics)


@contextlib.contextmanager
def forced_branch_draws(keep_chosen: dict[int, bool], *, q: float):
    """The branch draw's U[0,1) value is q/2 (chosen kept by ``u < q``) or (1+q)/2 (rejected kept).

    Only ``megatron_prune.sampling.uniform`` is replaced, so the real ``keep_chosen_branch``
    comparison with q turns each value into a kept branch. Counts the branch draws made.
    """
    from megatron_prune import sampling

    original = sampling.uniform
    calls = {"branch": 0}

    def uniform(seed, step, sample_id, what):
        if what == "branch":
            calls["branch"] += 1
            return q / 2 if keep_chosen[sample_id] else (1.0 + q) / 2
        return original(seed, step, sample_id, what)

    sampling.uniform = uniform
    try:
        yield calls
    finally:
        sampling.uniform = original


@contextlib.contextmanager
def forced_positions(by_length: dict[int, list[int]]):
    """The position draw returns ``by_length[T]`` for a response of T tokens.

    The real ``position_subset`` still runs and decides how many positions are kept; the forced
    subset must have exactly that size.
    """
    from megatron_prune import sampling

    original = sampling.position_subset

    def position_subset(length, **kw):
        real = original(length, **kw)
        forced = torch.tensor(by_length[length], dtype=real.dtype)
        assert len(forced) == len(real), f"forced {len(forced)} positions where the draw keeps {len(real)}"
        return forced

    sampling.position_subset = position_subset
    try:
        yield
    finally:
        sampling.position_subset = original


@contextlib.contextmanager
def replaced(module, name: str, replacement):
    """``module.name`` is ``replacement`` inside the block, the original again after it."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield original
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def recorded_pair_losses():
    """Record the (Δ_chosen, Δ_rejected) the step hands to the DPO loss."""
    import megatron_prune.dpo.step as step_mod

    original = step_mod.dpo_pair_losses
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def wrapped(chosen, rejected, **kw):
        seen.append((chosen.detach().double().clone(), rejected.detach().double().clone()))
        return original(chosen, rejected, **kw)

    with replaced(step_mod, "dpo_pair_losses", wrapped):
        yield seen


# -- 1. pruning off equals the reference -----------------------------------------------------------
def reference_checks() -> dict:
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel
    from tests.distributed import dpo_reference as R

    samples, _ = sample_pairs()
    pairs = [p for _, p in samples]
    with model_parallel(ParallelConfig(), seed=SEED):
        arch, policy, reference = _models()
        expected = {
            red: R.loss_and_grads(policy[0], reference[0], pairs, beta=BETA, vocab_size=arch.vocab_size, reduction=red)
            for red in ("mean", "sum")
        }
        got = [(case, _step(_runner(policy, reference, **case), policy, samples)) for case in REFERENCE_CASES]
    return dict(expected=expected, got=got)


@pytest.fixture(scope="module")
def reference_results() -> dict:
    return run_distributed(reference_checks, 1)[0]


@pytest.mark.distributed
def test_reference_margins_are_not_trivial(reference_results):
    """Policy and reference differ, so the checks below see non-zero margins of both signs."""
    margins = reference_results["expected"]["mean"]["margins"]
    assert (margins > 0).any() and (margins < 0).any() and margins.abs().min() > 1e-4


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(REFERENCE_CASES)),
                         ids=["-".join(f"{v}" for v in c.values()) for c in REFERENCE_CASES])
def test_pruning_off_equals_independent_reference(reference_results, index):
    case, got = reference_results["got"][index]
    assert case == REFERENCE_CASES[index]
    want = reference_results["expected"][case["reduction"]]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), f"{case}: loss"
    # What the run reports: means over the pairs of the margin, of each response's reward
    # beta * log-ratio, and of the ranking (a tie counts half).
    reported = got["metrics"]
    assert reported["margin"] == pytest.approx(float(want["margins"].mean()), rel=1e-5), f"{case}: margin"
    assert reported["chosen_reward"] == pytest.approx(BETA * float(want["chosen"].mean()), rel=1e-5), case
    assert reported["rejected_reward"] == pytest.approx(BETA * float(want["rejected"].mean()), rel=1e-5), case
    assert reported["reward_accuracy"] == R.reward_accuracy(want["margins"]), f"{case}: reward accuracy"
    from tests.distributed.dpo_reference import assert_grads_close

    assert_grads_close(want["grads"], got["grads"], str(case))


# -- 2. sequence pruning: DPO on the kept prefixes ----------------------------------------------------
SEQUENCE_CASES = [dict(layout=layout, reduction=reduction) for layout in ("concat", "shared") for reduction in ("mean", "sum")]


def _kept_prefix(length: int) -> int:
    """The prefix the forced sequence-pruning draw keeps: about two thirds, at least one token."""
    return max(1, (2 * length) // 3)


@contextlib.contextmanager
def forced_prefixes():
    """Every sequence-pruning draw keeps :func:`_kept_prefix` tokens; counts the draws."""
    from megatron_prune import sampling

    calls = {"prefix": 0}

    def prefix_length(length, **kw):
        calls["prefix"] += 1
        return _kept_prefix(length)

    with replaced(sampling, "prefix_length", prefix_length):
        yield calls


def sequence_pruning_checks() -> dict:
    import dataclasses

    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel

    samples, _ = sample_pairs()
    truncated = [dataclasses.replace(p, chosen_ids=p.chosen_ids[: _kept_prefix(len(p.chosen_ids))],
                                     rejected_ids=p.rejected_ids[: _kept_prefix(len(p.rejected_ids))])
                 for _, p in samples]
    cut = sum(len(t.chosen_ids) < len(p.chosen_ids) for t, (_, p) in zip(truncated, samples))
    with model_parallel(ParallelConfig(), seed=SEED):
        arch, policy, reference = _models()
        expected = {red: R.loss_and_grads(policy[0], reference[0], truncated, beta=BETA, vocab_size=arch.vocab_size,
                                          reduction=red) for red in ("mean", "sum")}
        with forced_prefixes() as calls:
            got = [(case, _step(_runner(policy, reference, seq_min_ratio=0.5, **case), policy, samples))
                   for case in SEQUENCE_CASES]
    return dict(expected=expected, got=got, draws=calls["prefix"], cut=cut)


@pytest.mark.distributed
def test_sequence_pruning_is_dpo_on_the_kept_prefixes():
    """Sequence pruning (forced draw: two thirds of each response) equals the reference DPO on the
    truncated pairs, in both layouts and both reductions: under ``sum`` each response's log-ratio
    is the sum over its kept prefix (its length after sequence pruning, not before)."""
    from tests.distributed.dpo_reference import assert_grads_close

    results = run_distributed(sequence_pruning_checks, 1)[0]
    assert results["draws"] > 0 and results["cut"] > 0, "no response was cut: the test would prove nothing"
    for case, got in results["got"]:
        want = results["expected"][case["reduction"]]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), f"{case}: loss"
        assert_grads_close(want["grads"], got["grads"], str(case))


# -- 3a. branch pruning: unbiased by enumeration through the real plan() ---------------------------
# layout: sample ids whose pruned branch joins the training row (the others: own rows), or None
# (the suffix -prefix-kv: pruned responses on the stored prompt keys; -packed: --dpo-pack-rows)
ENUM_LAYOUTS = {"concat": None, "shared": [0, 3], "shared-prefix-kv": None, "shared-prefix-kv-packed": None}


def branch_enumeration(q_values: tuple[float, ...], layout: str = "concat") -> dict:
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel
    from tests.distributed.dpo_harness import forced_join

    joined = ENUM_LAYOUTS[layout]
    join = None if joined is None else (lambda sid: sid in joined)
    samples = sample_pairs()[0][:ENUM_PAIRS]
    fixed = dict(position_ratio=0.6, seq_min_ratio=0.5)  # real position/prefix draws, the same in every pattern
    out = {}
    with model_parallel(ParallelConfig(), seed=SEED):
        _, policy, reference = _models()
        full = _step(_runner(policy, reference, **fixed), policy, samples)
        for q in q_values:
            runner = _runner(policy, reference, layout=layout.split("-")[0], **fixed, branch=True,
                             branch_chosen_prob=q, prefix_kv="-prefix-kv" in layout,
                             pack_rows=layout.endswith("-packed"))
            expectation: dict[str, torch.Tensor] = {}
            total_prob, losses, draws = 0.0, [], 0
            for pattern in itertools.product((True, False), repeat=ENUM_PAIRS):
                keep = {sid: k for (sid, _), k in zip(samples, pattern)}
                with forced_branch_draws(keep, q=q) as calls, forced_join(join):
                    got = _step(runner, policy, samples)
                draws += calls["branch"]
                prob = math.prod(q if k else 1.0 - q for k in pattern)
                total_prob += prob
                losses.append(got["loss"])
                for name, grad in got["grads"].items():
                    expectation[name] = expectation.get(name, 0.0) + prob * grad.double()
            out[q] = dict(expectation=expectation, total_prob=total_prob, losses=losses, draws=draws)
    return dict(full=full, by_q=out)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(ENUM_LAYOUTS))
def test_branch_pruning_is_unbiased_through_the_step(layout):
    qs = (0.3, 0.5)
    res = run_distributed(branch_enumeration, 1, q_values=qs, layout=layout)[0]
    from tests.distributed.dpo_reference import assert_grads_close

    for q in qs:
        got = res["by_q"][q]
        assert got["draws"] >= ENUM_PAIRS * 2**ENUM_PAIRS, "the branch draws were not controlled"
        assert got["total_prob"] == pytest.approx(1.0, abs=1e-12)
        assert_grads_close(res["full"]["grads"], {k: v.float() for k, v in got["expectation"].items()},
                           f"E[branch-pruned grad] at q={q}")
        # The loss value is not reweighted: every pattern reports the unpruned loss.
        for loss in got["losses"]:
            assert loss == pytest.approx(res["full"]["loss"], rel=1e-5)


# -- 3b. position pruning: the reward estimate is unbiased through the step ------------------------
CHOSEN_LEN, REJECTED_LEN, ALPHA = 4, 3, 0.5  # keeps 2 of 4 and 2 of 3 positions


def position_enumeration() -> dict:
    from megatron_prune.data.preference import PreferencePair
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel
    from tests.distributed import dpo_reference as R

    (_, source), = sample_pairs()[0][:1]
    pair = PreferencePair(prompt_ids=source.prompt_ids[-6:], chosen_ids=source.chosen_ids[:CHOSEN_LEN],
                          rejected_ids=source.rejected_ids[:REJECTED_LEN], source="test", line=1)
    assert pair.chosen_ids != pair.rejected_ids[:CHOSEN_LEN]
    samples = [(0, pair)]
    k_w, k_l = round(ALPHA * CHOSEN_LEN), round(ALPHA * REJECTED_LEN)
    chosen_subsets = list(itertools.combinations(range(CHOSEN_LEN), k_w))
    rejected_subsets = list(itertools.combinations(range(REJECTED_LEN), k_l))
    # Cycling both lists together over lcm runs visits every chosen and every rejected subset
    # equally often; Δ_chosen depends only on the chosen subset (and Δ_rejected likewise).
    runs = math.lcm(len(chosen_subsets), len(rejected_subsets))
    out = {}
    with model_parallel(ParallelConfig(), seed=SEED):
        arch, policy, reference = _models()
        for reduction in ("mean", "sum"):
            with torch.no_grad():
                w, l = R.pair_log_ratios(policy[0], reference[0], [pair], vocab_size=arch.vocab_size,
                                         reduction=reduction)
            out[(reduction, "reference")] = (float(w[0]), float(l[0]))
            with recorded_pair_losses() as seen:
                _step(_runner(policy, reference, reduction=reduction, micro_batch_size=1), policy, samples,
                      forward_only=True)
            out[(reduction, "unpruned")] = (float(seen[0][0][0]), float(seen[0][1][0]))
            for branch in ("off", "keep-chosen", "keep-rejected"):
                prune = dict(position_ratio=ALPHA)
                if branch != "off":
                    prune.update(branch=True, branch_chosen_prob=0.5)
                runner = _runner(policy, reference, reduction=reduction, micro_batch_size=1, **prune)
                estimates = []
                for i in range(runs):
                    subsets = {CHOSEN_LEN: list(chosen_subsets[i % len(chosen_subsets)]),
                               REJECTED_LEN: list(rejected_subsets[i % len(rejected_subsets)])}
                    with contextlib.ExitStack() as stack:
                        stack.enter_context(forced_positions(subsets))
                        seen = stack.enter_context(recorded_pair_losses())
                        if branch != "off":
                            stack.enter_context(forced_branch_draws({0: branch == "keep-chosen"}, q=0.5))
                        _step(runner, policy, samples, forward_only=True)
                    assert len(seen) == 1
                    estimates.append((float(seen[0][0][0]), float(seen[0][1][0])))
                out[(reduction, branch)] = estimates
    return out


@pytest.mark.distributed
def test_position_pruning_reward_estimate_is_unbiased_through_the_step():
    res = run_distributed(position_enumeration, 1)[0]
    for reduction in ("mean", "sum"):
        want = res[(reduction, "reference")]
        assert res[(reduction, "unpruned")] == pytest.approx(want, rel=1e-4, abs=1e-6)
        for branch in ("off", "keep-chosen", "keep-rejected"):
            estimates = torch.tensor(res[(reduction, branch)], dtype=torch.float64)
            assert estimates[:, 0].std() > 1e-4, "every subset gave the same estimate: nothing was enumerated"
            mean = estimates.mean(0).tolist()
            assert mean == pytest.approx(want, rel=1e-4, abs=1e-6), f"{reduction}/{branch}: E[Δ] != full Δ"


# -- 3c. draw frequencies ---------------------------------------------------------------------------
def _binomial_tolerance(p: float, n: int, sigmas: float = 5.0) -> float:
    return sigmas * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("q", [0.3, 0.5, 0.8])
def test_branch_draw_keeps_chosen_at_rate_q(q):
    from megatron_prune.sampling import keep_chosen_branch

    keys = [(step, sid) for step in range(40) for sid in range(60)]
    kept = [keep_chosen_branch(chosen_prob=q, seed=SEED, step=step, sample_id=sid) for step, sid in keys]
    rate = sum(kept) / len(kept)
    assert abs(rate - q) < _binomial_tolerance(q, len(kept)), f"chosen kept at rate {rate:.4f}, expected {q}"
    again = [keep_chosen_branch(chosen_prob=q, seed=SEED, step=step, sample_id=sid) for step, sid in keys[:50]]
    assert again == kept[:50]


def test_position_draw_keeps_alpha_of_positions_uniformly():
    from megatron_prune.sampling import position_subset

    for length in range(1, 25):
        for alpha in (0.3, 0.5, 0.6):
            got = position_subset(length, ratio=alpha, seed=SEED, step=length, sample_id=7, what="positions/chosen")
            assert len(got) == max(1, round(alpha * length)), (length, alpha)
            assert got.tolist() == sorted(set(got.tolist())) and 0 <= got.min() and got.max() < length
    length, alpha, n = 10, 0.6, 1500
    counts = torch.zeros(length)
    for key in range(n):
        subset = position_subset(length, ratio=alpha, seed=SEED, step=key // 50, sample_id=key % 50,
                                 what="positions/rejected")
        assert len(subset) == 6
        counts[subset] += 1
    freq = counts / n
    tol = _binomial_tolerance(alpha, n)
    assert (freq - alpha).abs().max() < tol, f"position frequencies {freq.tolist()} differ from {alpha}"


# -- 4. compute savings as structure ---------------------------------------------------------------
STRUCTURE_LAYOUTS = {"dp2": {}, "pp2": dict(pipeline_model_parallel_size=2),
                     "pp2-6pairs": dict(pipeline_model_parallel_size=2)}
STRUCTURE_PAIRS = {"pp2-6pairs": 6}  # pairs that do not fill doubled microbatches under PP


def _strip(row: list[int], pad_id: int) -> tuple[int, ...]:
    while row and row[-1] == pad_id:
        row = row[:-1]
    return tuple(row)


def structure_checks() -> dict:
    """Instrument one branch-pruned step per layout; return what each pass did on this rank."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    import megatron_prune.dpo.step as step_mod
    from megatron_prune.data.sampler import dp_shard
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel

    all_samples, pad_id = sample_pairs()
    out = {}
    for name, par in STRUCTURE_LAYOUTS.items():
        samples = all_samples[: STRUCTURE_PAIRS.get(name, len(all_samples))]
        with model_parallel(ParallelConfig(**par), seed=SEED):
            _, policy, reference = _models(par)
            mine = dp_shard(samples, dp_rank=parallel_state.get_data_parallel_rank(),
                            dp_size=parallel_state.get_data_parallel_world_size())
            keep = {sid: sid % 3 != 1 for sid, _ in samples}  # both branches kept somewhere
            passes: list[dict] = []
            originals = (step_mod.run_schedule, step_mod.policy_forward_step, schedules.backward_step)

            def run_schedule(*, model, data_iterator, forward_only, **kw):
                batches = list(data_iterator)
                kind = "reference" if model is reference else ("policy-forward-only" if forward_only else "train")
                rec = dict(kind=kind, forward_only=forward_only, forwards=[], backwards=0, packs=0,
                           rows=[_strip(r, pad_id) for b in batches for r in b.tokens.tolist()],
                           num_microbatches=len(batches))
                passes.append(rec)

                def pack(t):
                    rec["packs"] += 1
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return originals[0](model=model, data_iterator=iter(batches), forward_only=forward_only, **kw)

            def forward_step(data_iterator, model, **kw):
                output, loss_func = originals[1](data_iterator, model, **kw)
                passes[-1]["forwards"].append(dict(grad_enabled=torch.is_grad_enabled(),
                                                   has_graph=output.grad_fn is not None or output.requires_grad))
                return output, loss_func

            def backward_step(*args, **kw):
                passes[-1]["backwards"] += 1
                return originals[2](*args, **kw)

            step_mod.run_schedule, step_mod.policy_forward_step, schedules.backward_step = (
                run_schedule, forward_step, backward_step)
            try:
                runner = _runner(policy, reference, branch=True, branch_chosen_prob=0.5)
                with forced_branch_draws(keep, q=0.5):
                    _step(runner, policy, mine)
            finally:
                step_mod.run_schedule, step_mod.policy_forward_step, schedules.backward_step = originals
            kept = [_strip(p.prompt_ids + (p.chosen_ids if keep[sid] else p.rejected_ids), pad_id) for sid, p in mine]
            pruned = [_strip(p.prompt_ids + (p.rejected_ids if keep[sid] else p.chosen_ids), pad_id) for sid, p in mine]
            out[name] = dict(passes=passes, kept=kept, pruned=pruned,
                             last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True))
    return out


@pytest.mark.distributed
def test_branch_pruning_saves_compute_by_structure():
    results = run_distributed(structure_checks, 2)
    for rank, per_layout in enumerate(results):
        for layout, res in per_layout.items():
            label = f"rank {rank} {layout}"
            kinds = [p["kind"] for p in res["passes"]]
            assert kinds == ["reference", "policy-forward-only", "train"], f"{label}: passes {kinds}"
            ref_pass, pruned_pass, train = res["passes"]
            # (c) the training pass holds exactly the kept branches; the pruned pass the others.
            assert sorted(r for r in train["rows"] if r) == sorted(res["kept"]), f"{label}: training-pass rows"
            assert sorted(r for r in pruned_pass["rows"] if r) == sorted(res["pruned"]), f"{label}: pruned-pass rows"
            # The pruned pass holds one response per pair: twice the pairs per microbatch (2 x 2),
            # so half the forward calls, wherever every microbatch gets the same rows (always
            # without PP; under PP when the pairs fill them).
            n = len(res["pruned"])
            doubled = layout == "dp2" or n % 4 == 0
            assert pruned_pass["num_microbatches"] == -(-n // (4 if doubled else 2)), f"{label}: pruned microbatches"
            assert train["num_microbatches"] == -(-n // 2), f"{label}: training microbatches"
            # (b) exactly one backward per training microbatch, none for forward-only passes.
            assert train["backwards"] == train["num_microbatches"] > 0, f"{label}: backward steps"
            assert ref_pass["backwards"] == pruned_pass["backwards"] == 0, f"{label}: forward-only backward"
            # (a) no autograd graph in the forward-only passes (the training pass has one: the probe works).
            for p in (ref_pass, pruned_pass):
                assert p["forwards"] and not any(f["grad_enabled"] or f["has_graph"] for f in p["forwards"]), \
                    f"{label}: {p['kind']} pass built a graph"
            assert train["forwards"] and all(f["grad_enabled"] and f["has_graph"] for f in train["forwards"])
            # (d) forward-only passes save no tensors for backward.
            assert ref_pass["packs"] == pruned_pass["packs"] == 0, f"{label}: saved tensors in forward-only passes"
            assert train["packs"] > 0
