"""The GRPO objective as the trainer computes it: DPPO is unbiased through ``GRPOObjective`` and
``GRPOStep``, and the unpruned trainer step is plain GRPO.

* **Unbiasedness by exact enumeration, through the trainer.** The objective is built with
  ``build_objective`` on the tiny preset (toy task, a fixed rollout so that every keep pattern
  sees the same completions), prompt and completion pruning on, a prompt history that puts some
  prompts below keep probability 1, the KL term on (a reference model) and clipping active (two
  updates per rollout, old log-probs taken from a perturbed policy). The keep draws are
  controlled at the draw function only (``megatron_prune.grpo.dppo.keep_uniform``): for every
  uniform the trainer asks for, the test enumerates the intervals of [0, 1) on which the keep
  pattern is constant (breakpoints ``p`` for an independent draw; the fractional parts of the
  group's partial sums of keep probabilities for a systematic draw), runs the real
  ``train_step`` with the interval's midpoint, and weights the gradient by the interval's
  length. ``sum P(pattern) * gradient(pattern)`` must equal the gradient of the same step with
  both rates 0.
* **The unpruned step is GRPO.** With both rates 0, the loss and gradients of one trainer step
  equal an independent reference: plain PyTorch on the same model (full logits, ``log_softmax``,
  gather), group advantages ``(r - mean) / (std + 1e-6)``, the clipped surrogate plus ``beta *
  k3``, summed over tokens and divided by ``prompts x G x max_new_tokens``.
* ``reward_mean_weighted`` (rewards of the rolled-out prompts weighted by ``1/p``, over all
  prompts) has the unpruned ``reward_mean`` as its expectation.
* **Several updates per rollout.** ``--minibatches 2`` (``--ppo-epochs`` 1 and 2) and
  ``--loss-normalization sequence``: every ``train_step`` of one rollout, with an SGD step of the
  policy in between, equals a plain-PyTorch reference on its minibatch's prompts whose ratio takes
  the *rollout* policy's log-probs as old ones, divided by ``minibatch prompts x G x max_new_tokens``
  (sequence: each completion's token mean, divided by ``prompts x G``). One update per rollout
  (the default: old log-probs are the policy's own, detached), ``--no-std-normalization``,
  ``--advantage-std sample`` and ``--clip-eps-high`` above ``--clip-eps-low`` likewise, each far
  from the same update without its flag.
* Flags reach their level: ``--dppo-sampling`` rules the completion draw, ``--dppo-prompt-sampling``
  the prompt draw; with ``--minibatches 2`` and prompt pruning each minibatch trains its own
  slice of the prompt list.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

SEED = 2024
NUM_PROMPTS, GROUP, MAX_NEW = 3, 2, 3
KL_BETA = 0.1
PROMPT_RATE, PROMPT_FLOOR = 0.3, 0.2
COMPLETION_RATE, COMPLETION_FLOOR = 0.4, 0.25
OLD_POLICY_NOISE = 0.5  # relative perturbation of the weights that produce the old log-probs


# ---------------------------------------------------------------------------------------
# the objective under test
# ---------------------------------------------------------------------------------------


def _token_of_class(digit: int, k: int) -> int:
    """A toy-task token of digit class ``digit`` (ids from 4 up; class = (id - 4) % 10)."""
    return 4 + digit + 10 * k


FIXED_REWARDS = {0: [1.0, 1 / 3], 1: [0.0, 0.0], 2: [0.5, 0.0]}
"""The rewards of :func:`fixed_rollout`'s completions, written out: the reference uses these, and
the trainer's scorer must give the same (checked in ``fixed_rollout``)."""


def _rollout_of(source, rewards: dict[int, list[float]], completions) -> dict[int, list[list[int]]]:
    """``completions(right, wrong, eos)[prompt_id]`` for each prompt of ``rewards``, where
    ``right(k)``/``wrong(k)`` give a token of the prompt's answer class or not; the trainer's scorer
    must give each completion its reward in ``rewards``."""
    table = {}
    for prompt_id in rewards:
        digit = int(source.get(prompt_id).answer)
        right = functools.partial(_token_of_class, digit)
        wrong = functools.partial(_token_of_class, (digit + 1) % 10)
        table[prompt_id] = completions(right, wrong, source.eos_id)[prompt_id]
        scored = [source.score(source.get(prompt_id), c) for c in table[prompt_id]]
        assert scored == pytest.approx(rewards[prompt_id], abs=1e-12), (prompt_id, scored)
    return table


def fixed_rollout(source) -> dict[int, list[list[int]]]:
    """Completions of each prompt, chosen for their rewards (fraction of right-class tokens):
    prompt 0 (1, 1/3); prompt 1 (0, 0): a zero-variance group; prompt 2 (1/2, 0)."""
    return _rollout_of(source, FIXED_REWARDS, lambda right, wrong, eos: {
        0: [[right(1), right(7), eos], [right(2), wrong(3), wrong(5)]],
        1: [[wrong(4), wrong(8), wrong(1)], [wrong(6), eos]],
        2: [[right(3), wrong(2), eos], [wrong(9), wrong(11), wrong(2)]],
    })


class Harness:
    """One ``GRPOObjective`` whose every ``train_step(0)`` starts from the same state."""

    def __init__(self, *, policy, reference, arch, source, prompt_rate: float, completion_rate: float,
                 dense_packing: bool, sampling: str | None, kl_beta: float = KL_BETA,
                 skip_zero_advantage: bool = True, prompt_sampling: str | None = None) -> None:
        from megatron_prune.config import TrainConfig
        from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
        from megatron_prune.grpo.trainer import build_objective

        dppo = dict(prompt_prune_rate=prompt_rate, completion_prune_rate=completion_rate,
                    prompt_floor=PROMPT_FLOOR, completion_floor=COMPLETION_FLOOR, dense_packing=dense_packing,
                    skip_zero_advantage=skip_zero_advantage)
        if sampling is not None:  # the same rule at both levels unless prompt_sampling says otherwise
            dppo.update(sampling=sampling, prompt_sampling=prompt_sampling or sampling)
        configs = {
            "TrainConfig": TrainConfig(global_batch_size=NUM_PROMPTS, micro_batch_size=2, seq_length=16, seed=SEED),
            "GRPOConfig": GRPOConfig(group_size=GROUP, max_new_tokens=MAX_NEW, kl_beta=kl_beta, ppo_epochs=2,
                                     clip_eps_low=0.1, clip_eps_high=0.1, toy_num_prompts=NUM_PROMPTS),
            "DPPOArgs": DPPOArgs(**dppo),
        }
        self.policy = policy
        self.objective = build_objective(configs=configs, arch=arch, policy=policy, reference=reference,
                                         source=source)
        history = self.objective.pruner.history  # prompt 0 unseen (p = 1), prompt 1 always solved, prompt 2 mixed
        history.update(1, torch.tensor([1.0, 1.0]))
        history.update(2, torch.tensor([0.0, 1.0]))
        self.start = (self.objective.sampler.state_dict(), self.objective.pruner.state_dict())
        self.decisions: dict[str, object] = {}
        pruner = self.objective.pruner
        for name in ("select_prompts", "select_completions"):
            original = getattr(pruner, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                decision = _original(*args, **kwargs)
                self.decisions[_name] = decision
                return decision

            setattr(pruner, name, spy)
        runner = self.objective.runner
        original_score = runner.score

        def score(items, *, which):  # the rollout policy differs from the current one: ratios != 1
            if which != "old":
                return original_score(items, which=which)
            with perturbed(policy):
                return original_score(items, which=which)

        runner.score = score

    def step(self) -> tuple[dict, torch.Tensor]:
        """Metrics and the flat float64 gradient of ``train_step(0)`` from the saved state."""
        from megatron_prune.model.global_state import gather_global_state

        sampler, pruner = self.start
        self.objective.sampler.load_state_dict(sampler)
        self.objective.pruner.load_state_dict(pruner)
        self.objective.buffer = None
        self.decisions.clear()
        for chunk in self.policy:
            chunk.zero_grad_buffer()
        metrics = self.objective.train_step(0)
        grads = gather_global_state(self.policy, source="main_grad")
        return metrics, torch.cat([grads[k].flatten().double() for k in sorted(grads)])


class perturbed:
    """Adds a fixed relative perturbation to every policy weight inside the block; restores the
    exact weights on exit."""

    def __init__(self, policy) -> None:
        self.params = [p for chunk in policy for p in chunk.parameters()]

    def __enter__(self):
        generator = torch.Generator().manual_seed(SEED + 7)
        self.saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p in self.params:
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
                p.add_(OLD_POLICY_NOISE * noise * p.detach().abs().mean().clamp(min=1e-3))
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for p, saved in zip(self.params, self.saved):
                p.copy_(saved)
        return False


# ---------------------------------------------------------------------------------------
# enumerating the draws
# ---------------------------------------------------------------------------------------


def _intervals(breakpoints) -> list[tuple[float, float]]:
    """(midpoint, length) of the pieces of [0, 1) cut at ``breakpoints``."""
    cuts = sorted({0.0, 1.0, *(b for b in breakpoints if 0.0 < b < 1.0)})
    return [((a + b) / 2, b - a) for a, b in zip(cuts, cuts[1:]) if b - a > 1e-12]


def _fractional_partial_sums(probs: list[float]) -> list[float]:
    """Fractional parts of every subset sum of ``probs``: a superset of the breakpoints of a
    systematic draw over these items in any order (its cuts are partial sums in its order)."""
    sums = set()
    for r in range(1, len(probs) + 1):
        for subset in itertools.combinations(probs, r):
            total = math.fsum(subset)
            sums.add(total - math.floor(total))
    return sorted(sums)


def _breakpoints(key, *, level: str, decision, ids: list) -> list[float]:
    """Where the keep pattern of the items drawn with the uniform ``key`` can change.

    Keys: an item's own id (independent draws: the item is kept iff ``u < prob``); a prompt id
    at the completion level (systematic draw over that prompt's group); ``"batch"`` at the
    prompt level (systematic draw over the batch's prompts)."""
    probs = decision.probs
    if level == "prompt":
        if key == "batch":
            return _fractional_partial_sums(probs.tolist())
        return [float(probs[ids.index(key)])]
    if isinstance(key, tuple):  # (prompt id, j)
        return [float(probs[ids.index(key[0]), key[1]])]
    return _fractional_partial_sums(probs[ids.index(key)].tolist())


class Draws:
    """The stand-in for ``keep_uniform``: a table of uniforms (default 0), and the keys asked for."""

    def __init__(self) -> None:
        self.table: dict = {}
        self.asked: dict[str, list] = {"prompt": [], "completion": []}

    def __call__(self, *, seed, step, level, item_id):
        assert seed == SEED and step == 0
        self.asked[level].append(item_id)
        return self.table.get((level, item_id), 0.0)

    def enumerate(self, level: str, keys: list, *, decision, ids: list):
        """Yield (probability, table entries) for every combination of intervals of ``keys``."""
        choices = [[(key, u, length) for u, length in _intervals(_breakpoints(key, level=level, decision=decision,
                                                                               ids=ids))] for key in keys]
        for combo in itertools.product(*choices):
            yield math.prod(length for *_, length in combo), {(level, key): u for key, u, _ in combo}


def enumerate_expected_gradient(harness: Harness, draws: Draws) -> dict:
    """``sum P(pattern) * gradient(pattern)`` over every prompt and completion keep pattern, the total
    probability, each item's keep frequency and the number of patterns run."""
    draws.table.clear()
    draws.asked = {"prompt": [], "completion": []}
    harness.step()  # probe: which prompt keys are drawn, and the prompt keep probabilities
    prompt_decision = harness.decisions["select_prompts"]
    prompt_ids = list(harness.objective.sampler.epoch_order(0)[:NUM_PROMPTS])
    prompt_keys = list(dict.fromkeys(draws.asked["prompt"]))
    expected, total, runs, reward = None, 0.0, 0, 0.0
    prompt_freq = torch.zeros(NUM_PROMPTS, dtype=torch.float64)
    completion_freq: dict[tuple, float] = {}
    completion_marginal: dict[tuple, float] = {}
    for p_prompts, prompt_table in draws.enumerate("prompt", prompt_keys, decision=prompt_decision, ids=prompt_ids):
        draws.table = dict(prompt_table)
        draws.asked["completion"] = []
        harness.step()  # probe: the completion keys and probabilities under this prompt pattern
        kept = harness.decisions["select_prompts"].keep
        prompt_freq += p_prompts * kept.double()
        kept_ids = [i for i, k in zip(prompt_ids, kept.tolist()) if k]
        completion_keys = list(dict.fromkeys(draws.asked["completion"]))
        decision = harness.decisions["select_completions"]
        for k, prompt_id in enumerate(kept_ids):
            for j in range(GROUP):
                key = (prompt_id, j)
                completion_marginal[key] = completion_marginal.get(key, 0.0) + p_prompts * float(decision.probs[k, j])
        for p_completions, table in draws.enumerate("completion", completion_keys, decision=decision, ids=kept_ids):
            draws.table = {**prompt_table, **table}
            metrics, grad = harness.step()
            runs += 1
            got = harness.decisions["select_completions"]
            assert torch.equal(got.probs, decision.probs)
            probability = p_prompts * p_completions
            expected = probability * grad if expected is None else expected + probability * grad
            total += probability
            reward += probability * metrics["reward_mean_weighted"]
            for k, prompt_id in enumerate(kept_ids):
                for j in range(GROUP):
                    key = (prompt_id, j)
                    completion_freq[key] = completion_freq.get(key, 0.0) + probability * float(got.keep[k, j])
    return dict(expected=expected, total=total, runs=runs, prompt_freq=prompt_freq,
                prompt_probs=prompt_decision.probs, prompt_ids=prompt_ids, completion_freq=completion_freq,
                completion_marginal=completion_marginal, reward_mean_weighted=reward)


# ---------------------------------------------------------------------------------------
# the independent reference of plain GRPO
# ---------------------------------------------------------------------------------------


def reference_grpo(*, policy, reference, arch, source, prompt_ids: list[int], rollout,
                   kl_beta: float = KL_BETA) -> tuple[float, torch.Tensor]:
    """Loss and flat gradient of one GRPO step in plain PyTorch on the same model (no project code
    but the model): full logits, log_softmax, gather; advantages on the full group; clipped
    surrogate + beta * k3; token sum / (prompts x G x max_new_tokens)."""
    from megatron_prune.model.global_state import gather_global_state

    def completion_logprobs(model, prompt, completion, *, grad: bool):
        tokens = torch.tensor([prompt + completion])
        positions = torch.arange(tokens.shape[1])[None]
        with torch.enable_grad() if grad else torch.no_grad():
            logits = model(tokens, positions, None)[0, :, : arch.vocab_size].float()
            logp = torch.log_softmax(logits, dim=-1)
            where = torch.arange(len(completion)) + len(prompt) - 1
            return logp[where, torch.tensor(completion)]

    for chunk in policy:
        chunk.zero_grad_buffer()
    total = torch.zeros(())
    normaliser = NUM_PROMPTS * GROUP * MAX_NEW
    for prompt_id in prompt_ids:
        prompt = list(source.get(prompt_id).tokens)
        completions = rollout[prompt_id]
        rewards = torch.tensor(FIXED_REWARDS[prompt_id], dtype=torch.float64)
        advantages = ((rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-6)).float()
        for completion, advantage in zip(completions, advantages):
            with perturbed(policy):
                old = completion_logprobs(policy[0], prompt, completion, grad=False)
            ref = completion_logprobs(reference[0], prompt, completion, grad=False)
            logp = completion_logprobs(policy[0], prompt, completion, grad=True)
            ratio = torch.exp(logp - old)
            surrogate = -torch.minimum(ratio * advantage, ratio.clamp(0.9, 1.1) * advantage)
            k3 = torch.exp(ref - logp) - (ref - logp) - 1
            loss = (surrogate + kl_beta * k3).sum() / normaliser
            loss.backward()  # Megatron's DDP hooks accumulate into main_grad
            total = total + loss.detach()
    grads = gather_global_state(policy, source="main_grad")
    return float(total), torch.cat([grads[k].flatten().double() for k in sorted(grads)])


# ---------------------------------------------------------------------------------------
# the runs (one spawned rank)
# ---------------------------------------------------------------------------------------


def _objective_checks(*, sampling_modes: tuple, reference_step: bool, kl_beta: float = KL_BETA,
                      split_sampling: tuple = ()) -> dict:
    import megatron_prune.grpo.dppo as dppo
    import megatron_prune.grpo.trainer as trainer
    from megatron_prune.grpo.rollout import Completion
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    out: dict = {}
    original_generate, original_uniform = trainer.generate, dppo.keep_uniform
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=SEED)
        reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
        source = trainer.toy_source(vocab_size=arch.vocab_size, num_prompts=NUM_PROMPTS, seed=SEED, prompt_length=4)
        rollout = fixed_rollout(source)

        def generate(*, model, prompts, group_size, settings, step):
            assert group_size == GROUP
            return [[Completion(prompt_id=pid, index=j, tokens=list(rollout[pid][j])) for j in range(group_size)]
                    for pid, _ in prompts]

        draws = Draws()
        trainer.generate, dppo.keep_uniform = generate, draws
        try:
            build = functools.partial(Harness, policy=policy, reference=reference, arch=arch, source=source,
                                      kl_beta=kl_beta)
            full = build(prompt_rate=0.0, completion_rate=0.0, dense_packing=False, sampling=None)
            metrics, grad = full.step()
            out["full"] = dict(metrics=metrics, grad=grad, prompt_ids=full.objective.sampler.epoch_order(0))
            if kl_beta == 0:  # the same unpruned step training every completion, zero advantages too
                every = build(prompt_rate=0.0, completion_rate=0.0, dense_packing=False, sampling=None,
                              skip_zero_advantage=False)
                metrics, grad = every.step()
                out["every_completion"] = dict(metrics=metrics, grad=grad)
            for mode in sampling_modes:
                pruned = build(prompt_rate=PROMPT_RATE, completion_rate=COMPLETION_RATE, dense_packing=True,
                               sampling=mode)
                out[mode] = enumerate_expected_gradient(pruned, draws)
            for completion_rule, prompt_rule in split_sampling:  # which uniforms each level asks for
                pruned = build(prompt_rate=PROMPT_RATE, completion_rate=COMPLETION_RATE, dense_packing=True,
                               sampling=completion_rule, prompt_sampling=prompt_rule)
                draws.table.clear()
                draws.asked = {"prompt": [], "completion": []}
                pruned.step()
                out[(completion_rule, prompt_rule)] = {level: list(keys) for level, keys in draws.asked.items()}
        finally:
            trainer.generate, dppo.keep_uniform = original_generate, original_uniform
        if reference_step:
            loss, grad = reference_grpo(policy=policy, reference=reference, arch=arch, source=source,
                                        prompt_ids=out["full"]["prompt_ids"][:NUM_PROMPTS], rollout=rollout,
                                        kl_beta=kl_beta)
            out["reference"] = dict(loss=loss, grad=grad)
    return out


SAMPLING_MODES = ("independent", "systematic")


@functools.lru_cache(maxsize=None)
def results(mode: str | None) -> dict:
    """One launch per enumeration (and one for the reference check), so that a node id runs only its own."""
    modes = () if mode is None else (mode,)
    return run_distributed(_objective_checks, 1, sampling_modes=modes, reference_step=mode is None)[0]


def test_zero_advantage_completions_are_skipped_exactly_without_kl():
    """--kl-beta 0: the unpruned step leaves the zero-variance group out of the training pass and
    still equals the plain-PyTorch GRPO reference and the step that trains every completion; DPPO
    (systematic draws at both levels) never keeps a zero-advantage completion and its gradient,
    enumerated over every keep pattern, is the unpruned gradient."""
    got = run_distributed(_objective_checks, 1, sampling_modes=("systematic",), reference_step=True, kl_beta=0.0)[0]
    full, every, ref = got["full"], got["every_completion"], got["reference"]
    assert full["metrics"]["train_tokens"] < every["metrics"]["train_tokens"], "nothing was skipped"
    assert full["metrics"]["kept_completion_fraction"] == pytest.approx(2 / 3)  # prompt 1's two completions
    assert full["metrics"]["clip_fraction"] > 0.0
    torch.testing.assert_close(full["metrics"]["loss"], every["metrics"]["loss"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(full["metrics"]["loss"], ref["loss"], rtol=1e-5, atol=1e-7)
    _assert_grad_close(full["grad"], every["grad"], "skipping vs training every completion", rtol=1e-6)
    _assert_grad_close(full["grad"], ref["grad"], "trainer vs reference (no KL)", rtol=1e-4)
    result = got["systematic"]
    assert abs(result["total"] - 1.0) < 1e-9 and result["runs"] >= 4
    zero_variance = [key for key in result["completion_marginal"] if key[0] == 1]
    assert zero_variance and all(result["completion_freq"][key] == 0.0 for key in zero_variance)
    for key, frequency in result["completion_freq"].items():
        assert abs(frequency - result["completion_marginal"][key]) < 1e-9, (key, frequency)
    _assert_grad_close(result["expected"], every["grad"], "E[DPPO] vs GRPO (no KL)", rtol=1e-4)


def test_each_level_draws_by_its_own_sampling_flag():
    """--dppo-sampling sets the completion level's rule and --dppo-prompt-sampling the prompt
    level's: a systematic draw asks one uniform per group (completions) or per batch (prompts), an
    independent draw one per item."""
    splits = (("independent", "systematic"), ("systematic", "independent"))
    got = run_distributed(_objective_checks, 1, sampling_modes=(), reference_step=False, split_sampling=splits)[0]
    independent_completions, systematic_prompts = got[splits[0]]["completion"], got[splits[0]]["prompt"]
    assert systematic_prompts == ["batch"]
    assert independent_completions and all(isinstance(key, tuple) for key in independent_completions)
    systematic_completions, independent_prompts = got[splits[1]]["completion"], got[splits[1]]["prompt"]
    assert sorted(independent_prompts) == list(range(NUM_PROMPTS))
    assert systematic_completions and all(isinstance(key, int) for key in systematic_completions)


def _assert_grad_close(got: torch.Tensor, expected: torch.Tensor, label: str, *, rtol: float) -> None:
    scale = float(expected.abs().max())
    assert scale > 1e-4, f"{label}: the expected gradient is ~0: the test would prove nothing"
    error = float((got - expected).abs().max())
    assert error <= rtol * scale, f"{label}: max |difference| {error:.3g} > {rtol} x max |gradient| {scale:.3g}"


def test_unpruned_trainer_step_is_plain_grpo():
    """Rates 0: the trainer's loss and every gradient equal the plain-PyTorch GRPO reference, with
    the KL term on and clipping active."""
    got = results(None)
    full, ref = got["full"], got["reference"]
    assert full["metrics"]["clip_fraction"] > 0.0, f"the old policy should be far enough to clip: {full['metrics']}"
    assert full["metrics"]["kl_loss"] > 0.0
    torch.testing.assert_close(full["metrics"]["loss"], ref["loss"], rtol=1e-5, atol=1e-7)
    assert full["metrics"]["reward_mean_weighted"] == pytest.approx(full["metrics"]["reward_mean"], abs=1e-7)
    _assert_grad_close(full["grad"], ref["grad"], "trainer vs reference", rtol=1e-4)


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_dppo_trainer_gradient_is_unbiased_by_exact_enumeration(mode):
    """E over every prompt and completion keep pattern of the trainer's DPPO gradient = the unpruned
    trainer gradient; every item's keep frequency equals its keep probability."""
    got = results(mode)
    result = got[mode]
    assert abs(result["total"] - 1.0) < 1e-9, result["total"]
    probs = result["prompt_probs"]
    assert probs.min() < 1.0 and (probs < 1.0).sum() >= 2, f"some prompts must be pruned: {probs.tolist()}"
    torch.testing.assert_close(result["prompt_freq"], probs, rtol=0, atol=1e-9)
    assert result["runs"] >= 8
    assert set(result["completion_freq"]) == set(result["completion_marginal"])
    for key, frequency in result["completion_freq"].items():
        assert abs(frequency - result["completion_marginal"][key]) < 1e-9, (key, frequency)
    assert min(result["completion_marginal"].values()) < 0.5
    _assert_grad_close(result["expected"], got["full"]["grad"], f"{mode}: E[DPPO] vs GRPO", rtol=1e-4)
    # the weighted reward estimates the all-prompt mean reward without bias
    assert result["reward_mean_weighted"] == pytest.approx(got["full"]["metrics"]["reward_mean"], abs=1e-7)


# ---------------------------------------------------------------------------------------
# a checkpoint inside a rollout, on two data-parallel ranks
# ---------------------------------------------------------------------------------------


def _resume_inside_rollout() -> dict:
    """Objective A runs update 0 of a two-update rollout; its state (taken on every rank, as a save
    does) is loaded from rank 0 into a fresh objective B, as a resume does; the policy then moves (an
    optimizer step) and both run update 1. Each DP rank scored only its own share of the old and
    reference log-probs, so B needs the gathered ones."""
    import torch.distributed as dist

    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.trainer import build_objective, toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()  # two ranks: DP = 2
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=SEED)
        reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
        source = toy_source(vocab_size=arch.vocab_size, num_prompts=8, seed=SEED, prompt_length=4)
        configs = {
            "TrainConfig": TrainConfig(global_batch_size=4, micro_batch_size=2, seq_length=16, seed=SEED),
            "GRPOConfig": GRPOConfig(group_size=3, max_new_tokens=3, kl_beta=KL_BETA, ppo_epochs=2, toy_num_prompts=8),
            "DPPOArgs": DPPOArgs(completion_prune_rate=0.3, dense_packing=True),
        }

        def build():
            return build_objective(configs=configs, arch=arch, policy=policy, reference=reference, source=source)

        def step(objective, index):
            for chunk in policy:
                chunk.zero_grad_buffer()
            metrics = objective.train_step(index)
            grads = gather_global_state(policy, source="main_grad")
            return metrics, torch.cat([grads[k].flatten().double() for k in sorted(grads)])

        first = build()
        step(first, 0)
        state = first.state_dict()
        saved = [state if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(saved, src=0)
        resumed = build()
        resumed.load_state_dict(saved[0])
        with perturbed(policy):  # the update of step 0 moved the policy
            uninterrupted = step(first, 1)
            again = step(resumed, 1)
    return dict(uninterrupted=uninterrupted, resumed=again, has_rollout="rollout" in state)


def test_state_inside_a_rollout_restores_it_on_every_rank():
    for rank, got in enumerate(run_distributed(_resume_inside_rollout, 2)):
        assert got["has_rollout"]
        (metrics, grad), (metrics_resumed, grad_resumed) = got["uninterrupted"], got["resumed"]
        assert metrics_resumed["fresh_rollout"] == 0.0, "the resumed objective rolled out again"
        assert metrics["clip_fraction"] > 0.0  # the old log-probs are the rollout policy's, not the current one's
        for key in ("loss", "policy_loss", "kl_loss", "clip_fraction", "ratio_mean", "policy_tokens"):
            assert metrics_resumed[key] == metrics[key], (rank, key)
        # and the rollout's own metrics (rewards, kept fractions, lengths) come back with it; only clocks differ
        timeless = {key for key in metrics if not key.endswith("_time_s")}
        assert "reward_mean" in timeless and set(metrics_resumed) == set(metrics), sorted(metrics)
        assert {k: metrics_resumed[k] for k in timeless} == {k: metrics[k] for k in timeless}, rank
        assert torch.equal(grad_resumed, grad), rank


def _discard_a_saved_rollout() -> dict:
    """Three updates per rollout. Objective A trains rollout 0 and update 0 of rollout 1 and is saved
    there; B resumes with the same flags (reusing rollout 1), trains update 1 and is saved again,
    still inside rollout 1; C, at another --temperature, cannot reuse it and draws it again, and
    neither can resumes at another --loss-normalization, --max-new-tokens or --group-size."""
    import dataclasses

    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.trainer import build_objective, toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=SEED)
        source = toy_source(vocab_size=arch.vocab_size, num_prompts=6, seed=SEED, prompt_length=4)
        grpo = GRPOConfig(group_size=3, max_new_tokens=3, ppo_epochs=3, toy_num_prompts=6)
        configs = {
            "TrainConfig": TrainConfig(global_batch_size=4, micro_batch_size=4, seq_length=16, seed=SEED),
            "GRPOConfig": grpo,
            "DPPOArgs": DPPOArgs(prompt_prune_rate=0.5, completion_prune_rate=0.3, prompt_floor=0.2),
        }

        def build(**changes):
            return build_objective(configs={**configs, "GRPOConfig": dataclasses.replace(grpo, **changes)},
                                   arch=arch, policy=policy, reference=None, source=source)

        first = build()
        for step in range(3):
            first.train_step(step)
        before = (first.sampler.state_dict(), first.pruner.state_dict())
        first.train_step(3)
        after = first.sampler.state_dict()
        reused = build()
        reused.load_state_dict(first.state_dict())
        reused_metrics = reused.train_step(4)
        state = reused.state_dict()
        resumed = build(temperature=0.7)
        resumed.load_state_dict(state)
        loaded = (resumed.sampler.state_dict(), resumed.pruner.state_dict())
        metrics = resumed.train_step(5)
        # Every other flag the saved rollout was made for: its normalisers, groups and completions.
        others = {}
        for change in (dict(loss_normalization="sequence"), dict(max_new_tokens=4), dict(group_size=2)):
            other = build(**change)
            other.load_state_dict(state)
            others[str(change)] = other.train_step(5)["fresh_rollout"]
        return dict(has_rollout="rollout" in state, history=bool(before[1]["history"]["ids"]),
                    reused=reused_metrics["fresh_rollout"] == 0.0, loaded_before=loaded == before,
                    same_draw=resumed.sampler.state_dict() == after, fresh=metrics["fresh_rollout"],
                    moved=after != before[0], others=others)


def test_a_rollout_a_resume_cannot_reuse_is_drawn_again():
    """It used to keep the sampler position and prompt history saved after that rollout: the resume
    skipped the rollout's prompts, drew the next ones, and kept the discarded rewards in the history.
    A resume that reuses the rollout keeps the state from before it for its own saves."""
    (got,) = run_distributed(_discard_a_saved_rollout, 1)
    assert got["has_rollout"] and got["reused"] and got["history"] and got["moved"] and got["fresh"] == 1.0
    assert got["loaded_before"], "the resume did not go back to the state before the discarded rollout"
    assert got["same_draw"], "the resume drew other prompts than the discarded rollout's"
    assert got["others"] and all(fresh == 1.0 for fresh in got["others"].values()), got["others"]


# ---------------------------------------------------------------------------------------
# several updates per rollout (--minibatches, --ppo-epochs) and --loss-normalization sequence
# ---------------------------------------------------------------------------------------

MB_PROMPTS = 4
MB_CLIP = 0.05  # a tight clip, so that one SGD step moves some ratios past it
MB_LR = 0.02  # SGD step between the updates of a rollout: enough for some ratios to pass the clip (measured)
MB_REWARDS = {0: [1.0, 1 / 3], 1: [0.0, 1.0], 2: [0.5, 0.0], 3: [1.0, 0.5]}
FLAG_DEFAULTS = dict(clip_eps_high=MB_CLIP, normalize_std=True, advantage_std="population")
"""The GRPOConfig fields a run of :func:`_several_updates` may set (``run["flags"]``), at the values
the other runs use."""
"""The rewards of :func:`minibatch_rollout`'s completions, written out (checked against the scorer)."""


def minibatch_rollout(source) -> dict[int, list[list[int]]]:
    """Four prompts, every group with distinct rewards, completions of 1, 2 and 3 tokens."""
    table = _rollout_of(source, MB_REWARDS, lambda right, wrong, eos: {
        0: [[right(1), right(7), eos], [right(2), wrong(3), wrong(5)]],
        1: [[wrong(4), eos], [right(6)]],
        2: [[right(3), wrong(2), eos], [wrong(9), wrong(11), wrong(2)]],
        3: [[right(5), right(8), right(0)], [wrong(1), right(4)]],
    })
    lengths = {len(c) for group in table.values() for c in group}
    assert lengths == {1, 2, 3}
    return table


def _completion_logprobs(model, arch, prompt: list[int], completion: list[int], *, grad: bool) -> torch.Tensor:
    """Plain PyTorch: full logits, log_softmax, gather at the completion tokens."""
    tokens = torch.tensor([prompt + completion])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.enable_grad() if grad else torch.no_grad():
        logits = model(tokens, positions, None)[0, :, : arch.vocab_size].float()
        logp = torch.log_softmax(logits, dim=-1)
        where = torch.arange(len(completion)) + len(prompt) - 1
        return logp[where, torch.tensor(completion)]


def _flat_main_grad(policy) -> torch.Tensor:
    from megatron_prune.model.global_state import gather_global_state

    grads = gather_global_state(policy, source="main_grad")
    return torch.cat([grads[k].flatten().double() for k in sorted(grads)])


def _weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in policy for p in chunk.parameters()]


def _load_weights(policy, weights: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, w in zip((p for chunk in policy for p in chunk.parameters()), weights, strict=True):
            p.copy_(w)


def _sgd_step(policy, lr: float) -> None:
    """``p -= lr * main_grad``: the policy moves between the updates of one rollout."""
    with torch.no_grad():
        for chunk in policy:
            for p in chunk.parameters():
                if p.requires_grad:
                    p.add_(p.main_grad.to(p.dtype), alpha=-lr)


def reference_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, sample_std: bool = False) -> torch.Tensor:
    """``r - mean``, divided by ``std + eps`` unless ``normalize_std`` is off (Dr. GRPO); the sample
    std (``--advantage-std sample``) takes eps 1e-4, the population std 1e-6."""
    centred = rewards - rewards.mean()
    if not normalize_std:
        return centred.float()
    return (centred / (rewards.std(correction=1 if sample_std else 0) + (1e-4 if sample_std else 1e-6))).float()


def reference_minibatch(*, policy, reference, arch, source, prompt_ids: list[int], rollout, old: dict | None,
                        sequence: bool, kl_beta: float, clip: float, clip_high: float | None = None,
                        normalize_std: bool = True, sample_std: bool = False) -> tuple[float, torch.Tensor]:
    """Loss and flat gradient of one GRPO update on the prompts ``prompt_ids`` (a minibatch) at the
    policy's current weights, in plain PyTorch (no project code but the model).

    ``old[(prompt_id, j)]``: the old log-probs of the ratio (None: the current policy's, detached,
    i.e. ratio 1). Advantages ``(r - mean) / (std + 1e-6)`` on the full group (or as
    :func:`reference_advantages` is told). The ratio is clipped to ``[1 - clip, 1 + clip_high]``
    (``clip_high`` defaults to ``clip``). Per completion the token sum of ``clipped surrogate + beta * k3`` (``sequence``: divided by its length); summed over
    the minibatch and divided by ``len(prompt_ids) x G x max_new_tokens`` (``sequence``:
    ``len(prompt_ids) x G``)."""
    for chunk in policy:
        chunk.zero_grad_buffer()
    normaliser = len(prompt_ids) * GROUP * (1 if sequence else MAX_NEW)
    total = 0.0
    for prompt_id in prompt_ids:
        prompt = list(source.get(prompt_id).tokens)
        rewards = torch.tensor(MB_REWARDS[prompt_id], dtype=torch.float64)
        advantages = reference_advantages(rewards, normalize_std=normalize_std, sample_std=sample_std)
        for j, (completion, advantage) in enumerate(zip(rollout[prompt_id], advantages)):
            logp = _completion_logprobs(policy[0], arch, prompt, completion, grad=True)
            old_logp = logp.detach() if old is None else old[(prompt_id, j)]
            ratio = torch.exp(logp - old_logp)
            high = clip if clip_high is None else clip_high
            term = -torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + high) * advantage)
            if kl_beta > 0:
                ref = _completion_logprobs(reference[0], arch, prompt, completion, grad=False)
                term = term + kl_beta * (torch.exp(ref - logp) - (ref - logp) - 1)
            per_sequence = term.sum() / (len(completion) if sequence else 1)
            loss = per_sequence / normaliser
            loss.backward()  # Megatron's DDP hooks accumulate into main_grad
            total += float(loss.detach())
    return total, _flat_main_grad(policy)


def _several_updates(*, runs: list[dict], kl_beta: float = KL_BETA) -> list[dict]:
    """For each run (minibatches, ppo_epochs, normalization): every ``train_step`` of one rollout
    through ``build_objective`` (fixed rollout, no pruning), an SGD step after each; and at the
    weights each step started from, the reference gradient with the rollout policy's log-probs as
    old log-probs, and (negative control) with the current policy as old."""
    import megatron_prune.grpo.trainer as trainer
    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.rollout import Completion
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    out = []
    original_generate = trainer.generate
    with model_parallel(ParallelConfig(), seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, ParallelConfig(), seed=SEED)
        reference = setup_model(arch, ParallelConfig(), seed=SEED + 1, trainable=False)
        source = trainer.toy_source(vocab_size=arch.vocab_size, num_prompts=MB_PROMPTS, seed=SEED, prompt_length=4)
        rollout = minibatch_rollout(source)
        generated = []

        def generate(*, model, prompts, group_size, settings, step):
            generated.append(step)
            return [[Completion(prompt_id=pid, index=j, tokens=list(rollout[pid][j])) for j in range(group_size)]
                    for pid, _ in prompts]

        start = _weights(policy)
        old = {}  # the rollout policy's log-probs, computed here in plain PyTorch
        for prompt_id in range(MB_PROMPTS):
            prompt = list(source.get(prompt_id).tokens)
            for j, completion in enumerate(rollout[prompt_id]):
                old[(prompt_id, j)] = _completion_logprobs(policy[0], arch, prompt, completion, grad=False)
        trainer.generate = generate
        try:
            for run in runs:
                _load_weights(policy, start)
                generated.clear()
                flags = {**FLAG_DEFAULTS, **run.get("flags", {})}
                grpo = GRPOConfig(group_size=GROUP, max_new_tokens=MAX_NEW, kl_beta=kl_beta,
                                  ppo_epochs=run["ppo_epochs"], minibatches=run["minibatches"],
                                  loss_normalization=run["normalization"], clip_eps_low=MB_CLIP,
                                  toy_num_prompts=MB_PROMPTS, **flags)
                configs = {
                    "TrainConfig": TrainConfig(global_batch_size=MB_PROMPTS, micro_batch_size=run.get("micro_batch_size", 2),
                                               seq_length=16, seed=SEED),
                    "GRPOConfig": grpo,
                    "DPPOArgs": DPPOArgs(),
                }
                objective = trainer.build_objective(configs=configs, arch=arch, policy=policy, reference=reference,
                                                    source=source)
                order = list(objective.sampler.epoch_order(0)[:MB_PROMPTS])
                per = MB_PROMPTS // run["minibatches"]
                steps = []
                for step in range(run["ppo_epochs"] * run["minibatches"]):
                    before = _weights(policy)
                    for chunk in policy:
                        chunk.zero_grad_buffer()
                    metrics = objective.train_step(step)
                    steps.append(dict(metrics=metrics, grad=_flat_main_grad(policy), weights=before))
                    _sgd_step(policy, MB_LR)
                for step, record in enumerate(steps):
                    minibatch = step % run["minibatches"]
                    prompt_ids = order[minibatch * per : (minibatch + 1) * per]
                    _load_weights(policy, record["weights"])
                    kwargs = dict(policy=policy, reference=reference, arch=arch, source=source,
                                  prompt_ids=prompt_ids, rollout=rollout, sequence=run["normalization"] == "sequence",
                                  kl_beta=kl_beta, clip=MB_CLIP)
                    as_flags = dict(clip_high=flags["clip_eps_high"], normalize_std=flags["normalize_std"],
                                    sample_std=flags["advantage_std"] == "sample")
                    record["reference"] = reference_minibatch(old=old, **kwargs, **as_flags)
                    record["old_is_current"] = reference_minibatch(old=None, **kwargs, **as_flags)
                    # The same update without the run's flags: the check must tell them apart.
                    record["flags_ignored"] = reference_minibatch(old=old, **kwargs) if run.get("flags") else None
                    record["moved"] = max(float((w - s).abs().max()) for w, s in zip(record["weights"], start))
                    del record["weights"]
                out.append(dict(run=run, steps=steps, rollouts=list(generated)))
        finally:
            trainer.generate = original_generate
    return out


def _check_updates(result: dict, *, rtol: float = 1e-4) -> None:
    """Every update of the rollout equals the reference (old = the rollout policy); from the second
    on the policy has moved, some ratios clip, and the reference with old = the current policy is
    far from the trainer (the check is sensitive to which old log-probs are used)."""
    run, steps = result["run"], result["steps"]
    assert result["rollouts"] == [0], f"one rollout feeds every update: {result['rollouts']}"
    assert len(steps) == run["ppo_epochs"] * run["minibatches"]
    for step, record in enumerate(steps):
        metrics, grad = record["metrics"], record["grad"]
        loss, expected = record["reference"]
        label = f"{run} update {step}"
        torch.testing.assert_close(metrics["loss"], loss, rtol=1e-5, atol=1e-7, msg=label)
        _assert_grad_close(grad, expected, label, rtol=rtol)
        if step == 0:  # the rollout policy itself: ratio 1
            assert record["moved"] == 0.0 and metrics["clip_fraction"] == 0.0, label
            continue
        assert record["moved"] > 0.0
        assert metrics["clip_fraction"] > 0.0, f"{label}: no ratio clips, the old log-probs are not tested"
        assert abs(metrics["ratio_mean"] - 1.0) > 1e-3, label
        _, control = record["old_is_current"]
        error = float((grad - control).abs().max())
        assert error > 100 * rtol * float(expected.abs().max()), (
            f"{label}: old = current policy gives nearly the same gradient ({error:.3g}): the test is insensitive")


def _check_flags_matter(result: dict, *, rtol: float = 1e-4) -> None:
    """Some update of a run with ``flags`` is far from the same update without them: the reference
    check of that run is sensitive to whether the trainer applies them."""
    run = result["run"]
    distance = max(float((r["grad"] - r["flags_ignored"][1]).abs().max()) / float(r["reference"][1].abs().max())
                   for r in result["steps"])
    assert distance > 100 * rtol, f"{run}: the flags change the gradient by {distance:.3g} only: the test is insensitive"


def test_one_update_per_rollout_and_the_advantage_and_clip_flags():
    """The default one update per rollout (ratio 1, old log-probs = the policy's own, detached: the
    surrogate's gradient is the advantage-weighted score), and with it --no-std-normalization
    (Dr. GRPO) and --advantage-std sample; --clip-eps-high above --clip-eps-low (clip-higher) over
    two updates, where ratios move past the clip. Each equals the plain-PyTorch update with the
    same settings, which is far from the update without them."""
    runs = [dict(minibatches=1, ppo_epochs=1, normalization="constant"),
            dict(minibatches=1, ppo_epochs=1, normalization="constant", flags=dict(normalize_std=False)),
            dict(minibatches=1, ppo_epochs=1, normalization="constant", flags=dict(advantage_std="sample")),
            dict(minibatches=1, ppo_epochs=2, normalization="constant", flags=dict(clip_eps_high=4 * MB_CLIP))]
    for result in run_distributed(_several_updates, 1, runs=runs)[0]:
        _check_updates(result)
        if "flags" in result["run"]:
            _check_flags_matter(result)


def test_per_token_metrics_do_not_depend_on_the_microbatch_split():
    """kl, ratio_mean and clip_fraction are means over the update's trained tokens: the same two
    updates run as one microbatch or as one completion per microbatch (1 to 3 tokens each) report
    the same values, with some ratios clipped in the second update."""
    runs = [dict(minibatches=1, ppo_epochs=2, normalization="constant", micro_batch_size=size) for size in (1, 8)]
    split, whole = run_distributed(_several_updates, 1, runs=runs, kl_beta=KL_BETA)[0]
    assert split["steps"][1]["metrics"]["clip_fraction"] > 0.0
    for step, (a, b) in enumerate(zip(split["steps"], whole["steps"], strict=True)):
        for key in ("kl", "ratio_mean", "clip_fraction", "loss"):
            assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), (step, key)


def test_minibatch_updates_use_the_rollout_policy_as_old_and_the_minibatch_normaliser():
    """--minibatches 2 (with --ppo-epochs 1 and 2): every update of one rollout trains its minibatch's
    prompts with the normaliser minibatch prompts x G x max_new_tokens, and its ratio uses the
    rollout policy's log-probs as old ones (the policy moves between updates by an SGD step)."""
    runs = [dict(minibatches=2, ppo_epochs=1, normalization="constant"),
            dict(minibatches=2, ppo_epochs=2, normalization="constant")]
    for result in run_distributed(_several_updates, 1, runs=runs)[0]:
        _check_updates(result)


def test_sequence_normalisation_is_the_mean_over_each_completion():
    """--loss-normalization sequence, completions of 1, 2 and 3 tokens, two updates per rollout
    (--ppo-epochs 2): each update's loss and gradient are sum_j w_j / len_j sum_t term_jt / (P x G)."""
    runs = [dict(minibatches=1, ppo_epochs=2, normalization="sequence")]
    for result in run_distributed(_several_updates, 1, runs=runs)[0]:
        _check_updates(result)


def _minibatch_membership() -> dict:
    """One rollout of four prompts in two minibatches, the first prompt of the order pruned before
    rollout: which prompts each minibatch trains, and its normaliser."""
    import megatron_prune.grpo.trainer as trainer
    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.dppo import KeepDecision
    from megatron_prune.grpo.rollout import Completion
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    original_generate = trainer.generate
    with model_parallel(ParallelConfig(), seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, ParallelConfig(), seed=SEED)
        source = trainer.toy_source(vocab_size=arch.vocab_size, num_prompts=MB_PROMPTS, seed=SEED, prompt_length=4)
        rollout = minibatch_rollout(source)

        def generate(*, model, prompts, group_size, settings, step):
            return [[Completion(prompt_id=pid, index=j, tokens=list(rollout[pid][j])) for j in range(group_size)]
                    for pid, _ in prompts]

        configs = {
            "TrainConfig": TrainConfig(global_batch_size=MB_PROMPTS, micro_batch_size=2, seq_length=16, seed=SEED),
            "GRPOConfig": GRPOConfig(group_size=GROUP, max_new_tokens=MAX_NEW, minibatches=2, toy_num_prompts=MB_PROMPTS),
            "DPPOArgs": DPPOArgs(prompt_prune_rate=0.25, prompt_floor=0.5),
        }
        trainer.generate = generate
        try:
            objective = trainer.build_objective(configs=configs, arch=arch, policy=policy, reference=None, source=source)
            order = list(objective.sampler.epoch_order(0)[:MB_PROMPTS])

            def select_prompts(*, step, prompt_ids):  # the first prompt of the order is pruned
                probs = torch.tensor([0.5] + [1.0] * (len(prompt_ids) - 1), dtype=torch.float64)
                return KeepDecision(probs=probs, keep=probs == 1.0, target_rate=0.25)

            objective.pruner.select_prompts = select_prompts
            objective.train_step(0)
            buffer = objective.buffer
        finally:
            trainer.generate = original_generate
    return dict(order=order, minibatches=[sorted({item.prompt_id for item in items}) for items in buffer.minibatches],
                normalisers=buffer.normalisers)


def test_prompt_pruning_leaves_each_minibatch_its_own_slice():
    """--minibatches 2 with prompt pruning: minibatch m trains the kept prompts of its own slice of
    the step's prompt list (positions 2m, 2m+1), whichever prompts were pruned elsewhere, under the
    normaliser of the whole slice (pruned prompts included: the 1/p weights restore them)."""
    got = run_distributed(_minibatch_membership, 1)[0]
    order = got["order"]
    assert got["minibatches"] == [sorted(order[1:2]), sorted(order[2:4])]
    assert got["normalisers"] == [2.0 * GROUP * MAX_NEW] * 2
