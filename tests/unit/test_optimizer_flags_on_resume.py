"""A resume loads the checkpoint's optimizer state, param groups included: this launch's optimizer
flags (``--sgd-momentum``, ``--adam-beta1/2``, ``--adam-eps``) must apply after it, as the resume's
"flags that differ" line says. Checked on the Megatron optimizer ``build_optimizer`` gives a run
(one gloo rank, the tiny preset), loaded with the state another launch's optimizer saved."""

from __future__ import annotations

import pytest

from tests.dist import run_distributed

LR = 0.1


def _resumed_step(optimizer: str, saved_flags: dict, resumed_flags: dict) -> dict:
    """Train one step with ``saved_flags``, load that optimizer state into one built with
    ``resumed_flags`` (the resume's order: load, then this launch's flags), take a second step;
    what the second step's optimizer used and did to one weight."""
    import torch

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.loop import _apply_optimizer_flags
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    def weight(model):  # one trained weight and its gradient buffer
        return next(p for p in model[0].parameters() if p.requires_grad)

    def step(model, opt, grad: float):
        for p in model[0].parameters():
            p.main_grad.fill_(grad)
        opt.step()

    with model_parallel(ParallelConfig(), seed=3):
        first = setup_model(get_preset("tiny"), ParallelConfig(), seed=3)
        first_opt = build_optimizer(first, OptimConfig(optimizer=optimizer, lr=LR, clip_grad=0.0, **saved_flags),
                                    bf16=False)
        step(first, first_opt, 1.0)
        saved = first_opt.state_dict()

        resumed = setup_model(get_preset("tiny"), ParallelConfig(), seed=3)
        opt = build_optimizer(resumed, OptimConfig(optimizer=optimizer, lr=LR, clip_grad=0.0, **resumed_flags),
                              bf16=False)
        with torch.no_grad():
            weight(resumed).copy_(weight(first))
        opt.load_state_dict(saved)
        loaded = [dict(g) for inner in getattr(opt, "chained_optimizers", [opt]) for g in inner.optimizer.param_groups]
        _apply_optimizer_flags(opt)
        groups = [dict(g) for inner in getattr(opt, "chained_optimizers", [opt]) for g in inner.optimizer.param_groups]
        p = weight(resumed)
        before = p.detach().clone()
        step(resumed, opt, 1.0)
        return {"loaded": [{k: g[k] for k in ("momentum", "betas", "eps") if k in g} for g in loaded],
                "applied": [{k: g[k] for k in ("momentum", "betas", "eps") if k in g} for g in groups],
                "delta": (p.detach() - before).flatten()[:4].tolist()}


def test_a_changed_sgd_momentum_applies_after_the_checkpoints_state_is_loaded():
    """A checkpoint of --optimizer sgd at --sgd-momentum 0.9 resumed with --sgd-momentum 0.5: the
    loaded groups carry 0.9, the step after the resume uses 0.5. The first step's momentum buffer
    is its gradient (1), so the second step moves each weight by -lr * (0.5 * 1 + 1)."""
    got = run_distributed(_resumed_step, 1, optimizer="sgd", saved_flags={"sgd_momentum": 0.9},
                          resumed_flags={"sgd_momentum": 0.5})[0]
    assert got["loaded"] and all(g["momentum"] == 0.9 for g in got["loaded"])  # what the load alone leaves
    assert all(g["momentum"] == 0.5 for g in got["applied"])
    assert got["delta"] == pytest.approx([-LR * 1.5] * 4)
