"""Fused, chunked, vocab-parallel ops."""

from megatron_prune.ops.vocab_parallel_logprobs import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs"]
