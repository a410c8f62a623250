"""The local spec's SwiGLU: Megatron's own gated activation, forward and backward, keeping less."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_prune.model.swiglu import SwiGLU, _SwiGLUFunction


def megatron_glu(x: torch.Tensor) -> torch.Tensor:
    """What Megatron's MLP computes without fusion: chunk, silu(gate) * up."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def test_gradients_match_autograd_in_float64():
    x = torch.randn(3, 2, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLUFunction.apply, (x,))
    grad = torch.randn(3, 2, 6, dtype=torch.float64)
    got, = torch.autograd.grad(_SwiGLUFunction.apply(x), x, grad)
    want, = torch.autograd.grad(megatron_glu(x), x, grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_matches_megatrons_glu(dtype, tol):
    x = (2 * torch.randn(5, 3, 16)).to(dtype).requires_grad_(True)
    grad = torch.randn(5, 3, 8).to(dtype)
    got, want = _SwiGLUFunction.apply(x), megatron_glu(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops forward
    (g,), (w,) = torch.autograd.grad(got, x, grad), torch.autograd.grad(want, x, grad)
    assert g.dtype == w.dtype == dtype
    torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * float(w.abs().max()))


def test_keeps_only_the_fc1_output():
    x = torch.randn(10, 16, requires_grad=True)
    for fn, most in ((_SwiGLUFunction.apply, 1), (megatron_glu, 3)):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(x)
        storages = {t.untyped_storage().data_ptr() for t in saved}
        if fn is megatron_glu:
            assert len(storages) == 2  # the fc1 output (chunk views) and silu(gate)
        else:
            assert storages == {x.untyped_storage().data_ptr()}


def test_refuses_what_it_does_not_compute():
    ok = SimpleNamespace(activation_func=F.silu, gated_linear_unit=True, activation_func_clamp_value=None,
                         glu_linear_offset=0.0)
    SwiGLU(ok)
    for bad, named in ((dict(activation_func=F.gelu), "activation_func=F.silu"),
                       (dict(gated_linear_unit=False), "gated_linear_unit=True"),
                       (dict(activation_func_clamp_value=5.0), "activation_func_clamp_value"),
                       (dict(glu_linear_offset=1.0), "glu_linear_offset")):
        with pytest.raises(ValueError, match="SwiGLU") as exc:
            SwiGLU(SimpleNamespace(**{**vars(ok), **bad}))
        assert named in str(exc.value)
