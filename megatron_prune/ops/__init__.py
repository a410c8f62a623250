"""Fused, chunked, vocab-parallel ops (pure PyTorch: CUDA, Ascend NPU and CPU)."""

from megatron_prune.ops.vocab_parallel_logprobs import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs"]
