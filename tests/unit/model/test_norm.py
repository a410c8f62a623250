"""The local spec's RMSNorm: its hand-written backward against autograd on the composed ops, and
what it keeps for the backward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_prune.model.norm import RMSNorm, _RMSNormFunction


def composed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm written with PyTorch ops (HF Llama/Qwen: fp32 statistics, result in x's dtype)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm(hidden: int, dtype: torch.dtype, *, seed: int = 0) -> RMSNorm:
    module = RMSNorm(SimpleNamespace(params_dtype=dtype, sequence_parallel=False), hidden, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return module


def test_gradients_match_autograd_in_float64():
    module = norm(16, torch.float64)
    x = torch.randn(5, 3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x_, w: _RMSNormFunction.apply(x_, w, 1e-6), (x, module.weight))
    out_grad = torch.randn(5, 3, 16, dtype=torch.float64)
    got = torch.autograd.grad(module(x), (x, module.weight), out_grad)
    want = torch.autograd.grad(composed(x, module.weight, 1e-6), (x, module.weight), out_grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_forward_and_backward_match_the_composed_norm(dtype, tol):
    module = norm(64, dtype, seed=1)
    x = (3 * torch.randn(7, 2, 64)).to(dtype).requires_grad_(True)
    out_grad = torch.randn(7, 2, 64).to(dtype)
    got = module(x)
    want = composed(x, module.weight, 1e-6)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops forward
    for g, w in zip(torch.autograd.grad(got, (x, module.weight), out_grad),
                    torch.autograd.grad(want, (x, module.weight), out_grad)):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * float(w.abs().max()))


def test_frozen_weight_still_gives_the_input_its_gradient():
    """LoRA freezes the norms: the input's gradient is still the composed ops' one."""
    module = norm(8, torch.float32)
    module.weight.requires_grad_(False)
    x = torch.randn(4, 8, requires_grad=True)
    out_grad = torch.randn(4, 8)
    (got,) = torch.autograd.grad(module(x), x, out_grad)
    (want,) = torch.autograd.grad(composed(x, module.weight, 1e-6), x, out_grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert module.weight.grad is None


def _saved_full_size(fn, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of ``x``'s size that ``fn()``'s graph keeps for the backward (one per storage)."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    unique = {(t.untyped_storage().data_ptr(), t.dtype): t for t in saved if t.numel() == x.numel()}
    return list(unique.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_only_its_input_for_the_backward(dtype):
    """The composed ops also keep the fp32 normalised input (and in bf16 an fp32 copy of the
    input): the function keeps the input alone, in its own dtype (plus the per-token 1/rms)."""
    module = norm(32, dtype)
    x = torch.randn(10, 32).to(dtype).requires_grad_(True)
    ours = _saved_full_size(lambda: module(x), x)
    assert len(ours) == 1 and ours[0].dtype == dtype and ours[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert len(_saved_full_size(lambda: composed(x, module.weight, 1e-6), x)) >= 2
