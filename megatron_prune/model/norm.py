"""RMSNorm for the local (pure PyTorch) layer spec, with sequence parallelism.

Megatron's ``WrappedTorchNorm`` refuses sequence parallelism when neither Apex nor Transformer
Engine is installed. Under SP the norm sees a sequence shard, so its weight gradient is partial
on each TP rank; marking the weight ``sequence_parallel`` makes Megatron's
``finalize_model_grads`` sum it over the TP group, exactly as it does for TE's norms.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


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
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)
