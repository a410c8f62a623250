"""RMSNorm for the local (pure PyTorch) layer spec, with sequence parallelism.

Megatron's ``WrappedTorchNorm`` refuses sequence parallelism when neither Apex nor Transformer
Engine is installed. Under SP the norm sees a sequence shard, so its weight gradient is partial
on each TP rank; marking the weight ``sequence_parallel`` makes Megatron's
``finalize_model_grads`` sum it over the TP group, exactly as it does for TE's norms.

The norm is one autograd function that saves its input (in the input's dtype) and the per-token
``1/rms`` for the backward, and recomputes the normalised input there: composed of PyTorch ops,
autograd would also keep the fp32 normalised input, one more ``[tokens, hidden]`` tensor per norm.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x / sqrt(mean(x^2) + eps))``, normalised in fp32 (fp64 for fp64 input), the
    result cast to x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return weight * (x32 * inv_rms).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, inv_rms = ctx.saved_tensors
        x32 = x.to(inv_rms.dtype)
        normed = x32 * inv_rms
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(inv_rms.dtype)  # d loss / d normed
            grad_x = (inv_rms * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalised in fp32 as HF's Llama/Qwen norms do."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        **_ignored,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous():
            # Drop strides of size-1 dimensions (a one-row [s, 1, h] activation transposed from
            # [1, s, h] keeps a batch stride of s*h): torch.matmul picks its kernel for such a view
            # by whether the operands require gradients, so the trainable policy and a frozen copy
            # of it would round the next projection differently.
            x = x.view(x.shape)
        return _RMSNormFunction.apply(x, self.weight, self.eps)
