"""The fused, chunked log-prob op at TP=1 against a plain PyTorch reference.

The reference (``reference_logprobs``) is what Hugging Face / TRL compute for per-token
log-probs: full logits over the *unpadded* vocabulary, ``log_softmax`` in float, ``gather`` of
the label (TRL's ``selective_log_softmax``; HF's ``lm_head`` then ``logits.float()``). It runs in
float64 so that the fp32 op can be held to ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode  # private, but the only op-level hook

from megatron_prune.ops import vocab_parallel_logprobs

H, V = 8, 48


def reference_logprobs(hidden, weight, labels, *, vocab_size=None, temperature=None):
    """log_softmax(hidden @ weight[:vocab_size].T / T).gather(labels), in float64."""
    weight = weight[: vocab_size or weight.shape[0]]
    logits = hidden.double() @ weight.double().t()
    if temperature is not None:
        logits = logits / torch.as_tensor(temperature, dtype=torch.float64).reshape(-1, 1)
    return logits.log_softmax(dim=-1).gather(1, labels.unsqueeze(1)).squeeze(1)


def make_inputs(n, *, h=H, v=V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


def values_and_grads(fn, hidden, weight, labels, **kwargs):
    """fn's output and the gradients of <output, fixed random cotangent> w.r.t. hidden and weight."""
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    out = fn(hidden, weight, labels, **kwargs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * cotangent).sum().backward()
    return out, hidden.grad, weight.grad


def check_against_reference(hidden, weight, labels, *, atol=2e-6, rtol=1e-6, op_kwargs=None, ref_kwargs=None):
    out, gh, gw = values_and_grads(vocab_parallel_logprobs, hidden, weight, labels, **(op_kwargs or {}))
    ref, rh, rw = values_and_grads(reference_logprobs, hidden, weight, labels, **(ref_kwargs or {}))
    assert out.dtype == torch.float32 and out.shape == labels.shape
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    assert_close(out.double(), ref, atol=atol, rtol=rtol)
    assert_close(gh.double(), rh.double(), atol=atol, rtol=rtol)
    assert_close(gw.double(), rw.double(), atol=atol, rtol=rtol)
    return out, gh, gw


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 47, 48, 4096])  # 5 and 47 do not divide V=48
@pytest.mark.parametrize("n", [1, 13])
def test_fp32_matches_reference(n, chunk_size):
    hidden, weight, labels = make_inputs(n)
    check_against_reference(hidden, weight, labels, op_kwargs={"chunk_size": chunk_size})


def test_every_label_including_block_edges():
    """Labels 0, V-1 and both sides of every block boundary: each id once (n = V rows)."""
    hidden, weight, _ = make_inputs(V)
    labels = torch.arange(V).flip(0)
    check_against_reference(hidden, weight, labels, op_kwargs={"chunk_size": 16})


def test_empty_selection():
    hidden, weight, labels = make_inputs(0)
    out, gh, gw = values_and_grads(vocab_parallel_logprobs, hidden, weight, labels, chunk_size=7)
    assert out.shape == (0,) and out.dtype == torch.float32
    assert gh.shape == (0, H)
    assert torch.count_nonzero(gw) == 0


@pytest.mark.parametrize("chunk_size", [5, 16, 4096])
def test_padded_vocab_matches_unpadded_reference(chunk_size):
    vocab_size = 37  # rows 37..47 of the weight are padding
    hidden, weight, _ = make_inputs(21)
    labels = torch.tensor([0, vocab_size - 1, 15, 16, 17, 31, 32] * 3)
    # The reference only ever sees the unpadded weight; padding rows must get a zero gradient.
    out, gh, gw = values_and_grads(
        vocab_parallel_logprobs, hidden, weight, labels, chunk_size=chunk_size, vocab_size=vocab_size
    )
    ref, rh, rw = values_and_grads(reference_logprobs, hidden, weight[:vocab_size], labels)
    assert_close(out.double(), ref, atol=2e-6, rtol=1e-6)
    assert_close(gh.double(), rh.double(), atol=2e-6, rtol=1e-6)
    assert_close(gw[:vocab_size].double(), rw.double(), atol=2e-6, rtol=1e-6)
    assert torch.count_nonzero(gw[vocab_size:]) == 0
    # Negative control: without the padding mask the padding rows enter the normalisation.
    unmasked = vocab_parallel_logprobs(hidden, weight, labels, chunk_size=chunk_size)
    assert (unmasked.double() - ref).abs().max() > 1e-2


@pytest.mark.parametrize(
    "temperature",
    [0.7, torch.tensor(1.3), "per-row"],
    ids=["float", "0-dim", "per-row"],
)
def test_temperature(temperature):
    hidden, weight, labels = make_inputs(11)
    if temperature == "per-row":
        temperature = torch.linspace(0.5, 2.0, 11)
    check_against_reference(
        hidden, weight, labels,
        op_kwargs={"chunk_size": 5, "temperature": temperature},
        ref_kwargs={"temperature": temperature},
    )


def test_bf16_close_to_fp32_reference():
    """bf16 inputs: logits are a bf16 GEMM (as HF's bf16 lm_head), everything after is fp32.

    Tolerance: the bf16 rounding of logits of magnitude ~5 is ~2e-2 absolute; log-probs and
    gradients are compared with atol 5e-2 / rtol 2e-2 to the float64 reference computed from the
    same (bf16-rounded) inputs. The fp32 op on those inputs is held to 2e-6 as a control.
    """
    hidden, weight, labels = make_inputs(33, h=64, v=96, dtype=torch.bfloat16)
    out, gh, gw = check_against_reference(
        hidden, weight, labels, atol=5e-2, rtol=2e-2, op_kwargs={"chunk_size": 40}
    )
    assert gh.dtype == gw.dtype == torch.bfloat16
    check_against_reference(hidden.float(), weight.float(), labels, op_kwargs={"chunk_size": 40})


def test_hidden_dtype_differs_from_weight():
    hidden, weight, labels = make_inputs(9)
    out, gh, gw = values_and_grads(vocab_parallel_logprobs, hidden.double(), weight, labels, chunk_size=5)
    ref, rh, rw = values_and_grads(reference_logprobs, hidden, weight, labels)
    assert gh.dtype == torch.float64 and gw.dtype == torch.float32
    assert_close(out.double(), ref, atol=2e-6, rtol=1e-6)
    assert_close(gh, rh.double(), atol=2e-6, rtol=1e-6)


def test_gradient_for_only_one_input_and_no_grad():
    hidden, weight, labels = make_inputs(9)
    ref, rh, rw = values_and_grads(reference_logprobs, hidden, weight, labels)
    w = weight.clone().requires_grad_(True)
    vocab_parallel_logprobs(hidden, w, labels, chunk_size=5).double().mul(_cotangent(9)).sum().backward()
    assert_close(w.grad.double(), rw.double(), atol=2e-6, rtol=1e-6)
    x = hidden.clone().requires_grad_(True)
    vocab_parallel_logprobs(x, weight, labels, chunk_size=5).double().mul(_cotangent(9)).sum().backward()
    assert_close(x.grad.double(), rh.double(), atol=2e-6, rtol=1e-6)
    with torch.no_grad():
        assert_close(vocab_parallel_logprobs(x, w, labels).double(), ref, atol=2e-6, rtol=1e-6)


def _cotangent(n):
    return torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_saves_nothing_of_size_n_by_vocab():
    n, h, v = 64, 8, 96  # n > h, so n*V exceeds every input (weight has V*h elements)
    hidden, weight, labels = make_inputs(n, h=h, v=v)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = vocab_parallel_logprobs(hidden, weight, labels, chunk_size=16)
    assert saved and max(saved) <= max(n * h, v * h) < n * v
    out.sum().backward()


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any ATen op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_forward_and_backward_never_hold_more_than_one_block():
    n, h, v, chunk = 64, 8, 96, 16
    hidden, weight, labels = make_inputs(n, h=h, v=v)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with _LargestTensor() as forward:
        out = vocab_parallel_logprobs(hidden, weight, labels, chunk_size=chunk)
    with _LargestTensor() as backward:
        out.sum().backward()
    bound = max(n * chunk, v * h)  # one [n, chunk] block of logits, or the weight's gradient
    assert forward.largest <= bound and backward.largest <= bound < n * v
    # Control: the recorder does see a full [n, V] tensor when one is formed.
    with _LargestTensor() as full:
        reference_logprobs(hidden, weight, labels)
    assert full.largest >= n * v


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden": torch.zeros(3, H + 1)}, "shape mismatch"),
        ({"hidden": torch.zeros(4, H)}, "shape mismatch"),
        ({"hidden": torch.zeros(3)}, "expected hidden"),
        ({"labels": torch.zeros(3)}, "integer token ids"),
        ({"weight": torch.zeros(V, H, dtype=torch.int32)}, "floating point"),
        ({"labels": torch.tensor([0, V, 1])}, r"\[0, vocab_size=48\)"),
        ({"labels": torch.tensor([0, -1, 1])}, "token ids"),
        ({"labels": torch.tensor([0, 40, 1]), "vocab_size": 40}, r"\[0, vocab_size=40\)"),
        ({"vocab_size": V + 1}, "vocab_size must be in"),
        ({"vocab_size": 0}, "vocab_size must be in"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"temperature": 0.0}, "temperature must be positive"),
        ({"temperature": torch.tensor([1.0, -1.0, 1.0])}, "temperature must be positive"),
        ({"temperature": torch.ones(2)}, "scalar or a"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    args = {"hidden": torch.zeros(3, H), "weight": torch.zeros(V, H), "labels": torch.tensor([0, 1, 2])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        vocab_parallel_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)
