"""Megatron's torch-AdamW fallback is switched to torch's fused kernel: same update, fewer temporaries."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_prune.training.model_setup import prefer_fused_torch_adam


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1000, 257, 64)]


def test_fused_update_matches_the_for_loop_adamw():
    fused, plain = _params(0), _params(0)
    a = torch.optim.AdamW(fused, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    b = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=a)])
    assert prefer_fused_torch_adam(chained) == 1
    assert a.param_groups[0]["fused"] and not b.param_groups[0]["fused"]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(fused, plain):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(fused, plain):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_an_optimizer_with_state_or_another_kernel_is_left_alone():
    params = _params(2)
    started = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    started.step()  # state exists: its step counters were made for the for-loop kernel
    sgd = torch.optim.SGD(_params(3), lr=0.1)
    assert prefer_fused_torch_adam(types.SimpleNamespace(optimizer=started)) == 0
    assert prefer_fused_torch_adam(types.SimpleNamespace(optimizer=sgd)) == 0
    assert not started.param_groups[0]["fused"]


def test_fp64_parameters_keep_the_default_kernel():
    params = [torch.nn.Parameter(torch.randn(8, dtype=torch.float64))]
    opt = torch.optim.AdamW(params, lr=1e-2)
    assert prefer_fused_torch_adam(types.SimpleNamespace(optimizer=opt)) == 0


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_both_adam_classes(cls):
    opt = cls(_params(4), lr=1e-3)
    assert prefer_fused_torch_adam(types.SimpleNamespace(optimizer=opt)) == 1
