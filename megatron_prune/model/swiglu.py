"""SwiGLU for the local layer spec's MLP that keeps only its input for the backward.

Megatron's unfused gated MLP computes ``silu(gate) * up`` with PyTorch ops, so autograd keeps
``silu(gate)`` (one ``[tokens, ffn]`` tensor per layer) besides the fc1 output it chunks. This
function keeps the fc1 output alone and recomputes ``silu`` in the backward, as Megatron's fused
``bias_swiglu`` does (which needs ``torch.compile``). The MLP takes it through its spec: with
``use_te_activation_func`` set, Megatron's ``MLP`` builds ``submodules.activation_func`` and
applies it to the whole fc1 output (the flag's only effect; no Transformer Engine is involved).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(x1) * x2`` for ``x = [x1, x2]`` on the last dimension (each rank's local
    ``[gate shard; up shard]``, as Megatron's own ``glu`` chunks it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        compute = torch.promote_types(x.dtype, torch.float32)
        gate, up = (t.to(compute) for t in torch.chunk(x, 2, dim=-1))
        g = grad.to(compute)
        out = torch.empty_like(x)
        width = gate.shape[-1]
        # d/d gate = g · up · silu'(gate) by aten's one-kernel silu_backward, d/d up = g · silu(gate);
        # each written straight into its half of the result (four passes over [tokens, ffn] in all).
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=out[..., :width])
        torch.mul(g, F.silu(gate), out=out[..., width:])
        return out


class SwiGLU(torch.nn.Module):
    """The MLP's activation module (``MLPSubmodules.activation_func``)."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.activation_func is not F.silu or not config.gated_linear_unit:
            raise ValueError("SwiGLU needs activation_func=F.silu with gated_linear_unit=True")
        if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0):
            raise ValueError("SwiGLU does not implement activation_func_clamp_value or glu_linear_offset")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SwiGLUFunction.apply(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """No weights: nothing in a checkpoint (Megatron's MLP asks each child for its part)."""
        return {}
