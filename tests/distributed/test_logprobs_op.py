"""The fused log-prob op at TP=2 (two gloo ranks, one launch) against the single-process reference.

Rank r holds vocabulary shard r (global rows [r*V/2, (r+1)*V/2)) and communicates over the default
(world) group; no Megatron parallel state is involved. The reference is the same float64
``log_softmax + gather`` over the unsharded, unpadded weight as in the unit tests (what HF / TRL
compute). Every case checks the values, the complete ``grad_hidden`` (identical on both ranks) and
each rank's gradient for its own shard. A negative control runs with the shards swapped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_prune.ops import vocab_parallel_logprobs
from tests.dist import run_distributed
from tests.unit.ops.test_vocab_parallel_logprobs import make_inputs, reference_logprobs, values_and_grads

pytestmark = pytest.mark.distributed

TP, H, V = 2, 8, 48
SHARD = V // TP
BOUNDARY_LABELS = [0, SHARD - 1, SHARD, SHARD + 1, V - 1]

CASES = {
    # name: (n, chunk_size, vocab_size, temperature, dtype, labels prefix)
    "fp32": (13, 5, None, None, torch.float32, BOUNDARY_LABELS),
    "one_block_per_shard": (13, 4096, None, None, torch.float32, BOUNDARY_LABELS),
    "padded": (15, 5, 37, None, torch.float32, [0, SHARD - 1, SHARD, 36]),
    "rank1_all_padding": (9, 7, 20, None, torch.float32, [0, 19]),
    "temperature": (11, 16, 41, "per-row", torch.float32, BOUNDARY_LABELS[:-1] + [40]),
    "bf16": (17, 10, None, None, torch.bfloat16, BOUNDARY_LABELS),
    "empty": (0, 5, None, None, torch.float32, []),
}


def case_inputs(name):
    n, chunk_size, vocab_size, temperature, dtype, prefix = CASES[name]
    hidden, weight, labels = make_inputs(n, h=H, v=V, dtype=dtype, seed=len(name))
    labels = labels % (vocab_size or V)
    labels[: len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    if temperature == "per-row":
        temperature = torch.linspace(0.5, 2.0, n)
    return hidden, weight, labels, dict(chunk_size=chunk_size, vocab_size=vocab_size, temperature=temperature)


def _tp2_worker():
    """On each rank: every case with shard ``rank``, plus the swapped-shard control."""
    rank, group = dist.get_rank(), dist.group.WORLD
    results = {}
    for name in CASES:
        hidden, weight, labels, kwargs = case_inputs(name)
        shard = weight[rank * SHARD : (rank + 1) * SHARD]
        results[name] = values_and_grads(vocab_parallel_logprobs, hidden, shard, labels, tp_group=group, **kwargs)
    hidden, weight, labels, kwargs = case_inputs("fp32")
    swapped = weight[(1 - rank) * SHARD : (2 - rank) * SHARD]
    results["swapped"] = vocab_parallel_logprobs(hidden, swapped, labels, tp_group=group, **kwargs)
    return results


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_tp2_worker, TP)


def _tolerance(dtype):
    return dict(atol=5e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_single_process_reference(tp2_results, name):
    hidden, weight, labels, kwargs = case_inputs(name)
    vocab_size = kwargs["vocab_size"] or V
    ref, ref_grad_hidden, ref_grad_weight = values_and_grads(
        reference_logprobs, hidden, weight[:vocab_size], labels, temperature=kwargs["temperature"]
    )
    full_grad_weight = torch.zeros(V, H, dtype=torch.float64)
    full_grad_weight[:vocab_size] = ref_grad_weight.double()
    tol = _tolerance(hidden.dtype)
    for rank, (out, grad_hidden, grad_shard) in enumerate(r[name] for r in tp2_results):
        assert out.dtype == torch.float32 and out.shape == labels.shape
        assert grad_hidden.dtype == grad_shard.dtype == hidden.dtype
        assert_close(out.double(), ref, **tol)
        assert_close(grad_hidden.double(), ref_grad_hidden.double(), **tol)
        assert_close(grad_shard.double(), full_grad_weight[rank * SHARD : (rank + 1) * SHARD], **tol)
    (out0, gh0, _), (out1, gh1, _) = (r[name] for r in tp2_results)
    assert torch.equal(out0, out1) and torch.equal(gh0, gh1), "TP ranks must return identical results"


def test_tp2_equals_tp1_op(tp2_results):
    """Layout independence: the same op at TP=1 on the whole weight gives the TP=2 result."""
    for name in ("fp32", "padded", "temperature"):
        hidden, weight, labels, kwargs = case_inputs(name)
        out, grad_hidden, grad_weight = values_and_grads(vocab_parallel_logprobs, hidden, weight, labels, **kwargs)
        tp2_out, tp2_grad_hidden, _ = tp2_results[0][name]
        assert_close(tp2_out, out, atol=2e-6, rtol=1e-6)
        assert_close(tp2_grad_hidden, grad_hidden, atol=2e-6, rtol=1e-6)
        assert_close(torch.cat([r[name][2] for r in tp2_results]), grad_weight, atol=2e-6, rtol=1e-6)


def test_swapped_shards_are_detected(tp2_results):
    """Negative control: the same ranks with shard order swapped must not match the reference."""
    hidden, weight, labels, kwargs = case_inputs("fp32")
    ref = reference_logprobs(hidden, weight, labels)
    assert (tp2_results[0]["swapped"].double() - ref).abs().max() > 1e-2
