"""log p(label) of selected rows from hidden states and a vocab-parallel output weight.

The selective LM head's last step: given ``n`` selected hidden states and this tensor-parallel
rank's shard of the output (or tied embedding) weight, return the fp32 log-probability of each
row's label without ever forming the ``[n, V/tp]`` logits.

Chunking is over the **vocabulary**: the local shard's rows are visited ``chunk_size`` at a
time, so at most one ``[n, chunk_size]`` block of logits (plus its fp32 copy) is alive, in the
forward and in the backward. The forward keeps an online max / sum-exp per row; the backward
recomputes each block's logits from the saved ``hidden``, ``weight``, ``labels`` and per-row
log-sum-exp. Peak extra memory is about ``n * chunk_size * (4 + 4 + itemsize)`` bytes plus an
fp32 ``[n, h]`` gradient buffer, independent of the vocabulary size.

Numerics, chosen to match Hugging Face / Megatron:
- each block of logits is a GEMM in the weight's dtype, then upcast to fp32 (as HF's lm_head
  followed by ``logits.float()``); max, sum-exp, softmax and ``grad_logits`` are fp32;
- ``grad_hidden`` is accumulated over vocabulary blocks in fp32 and all-reduced in fp32;
- each ``grad_weight`` block is one GEMM reducing over all ``n`` rows (fp32 accumulation inside
  the GEMM) and is written once; there is no cross-block accumulation.

Tensor parallelism: TP rank ``r`` holds global vocabulary rows ``[r*V/tp, (r+1)*V/tp)``. The
forward all-reduces the per-row max (MAX), then the rescaled sum-exp and the target logit (one
SUM: the label lives on exactly one rank). The backward all-reduces ``grad_hidden`` so that every
rank returns the complete gradient, as the input of a ColumnParallelLinear gets; ``grad_weight``
stays local. Global rows ``>= vocab_size`` are padding: they are never multiplied, never enter
the normalisation and get a zero gradient.

Pure PyTorch (no Triton, no fused kernels) so that it runs on CUDA, Ascend NPUs and CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["vocab_parallel_logprobs"]


@dataclass(frozen=True)
class _Shard:
    """Which part of the global vocabulary this rank's weight rows hold."""

    group: dist.ProcessGroup | None
    """TP group to communicate over; None when there is nothing to communicate."""
    start: int
    """Global id of local row 0."""
    valid_rows: int
    """Local rows that are real tokens (the rest are vocabulary padding)."""


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 4096,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """fp32 ``[n]`` log p(labels) of ``hidden @ weight.T`` (over the full, unpadded vocabulary).

    Args:
        hidden: ``[n, h]`` hidden states of the selected rows, any float dtype (cast to the
            weight's dtype for the GEMMs; its gradient comes back in its own dtype).
        weight: ``[V/tp, h]`` this rank's shard of a vocab-parallel output layer or tied
            embedding.
        labels: ``[n]`` global token ids.
        chunk_size: vocabulary rows per block; memory grows as ``n * chunk_size``.
        tp_group: the tensor-parallel group the vocabulary is split over; None (or a group of
            size 1) means the weight is the whole vocabulary and nothing is communicated.
        vocab_size: the true vocabulary size; global rows ``>= vocab_size`` are padding.
            Defaults to ``tp * V/tp`` (no padding).
        temperature: positive scalar or ``[n]`` tensor dividing the logits of each row. It is a
            constant: no gradient flows into it.

    Raises ValueError for bad shapes, dtypes, devices, labels outside ``[0, vocab_size)`` or a
    non-positive temperature (the value checks cost one host synchronisation per call).
    """
    _check_tensors(hidden, weight, labels)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    tp_size, tp_rank = _size_and_rank(tp_group)
    local_rows = weight.shape[0]
    global_rows = tp_size * local_rows
    vocab_size = global_rows if vocab_size is None else vocab_size
    if not 1 <= vocab_size <= global_rows:
        raise ValueError(f"vocab_size must be in [1, {global_rows}] (tp x weight rows); got {vocab_size}")
    start = tp_rank * local_rows
    shard = _Shard(
        group=tp_group if tp_size > 1 else None,
        start=start,
        valid_rows=min(local_rows, max(0, vocab_size - start)),
    )
    temperature = _per_row_temperature(temperature, n=labels.shape[0], device=hidden.device)
    _check_values(labels, temperature, vocab_size=vocab_size)
    return _VocabParallelLogprobs.apply(hidden, weight, labels.long(), temperature, chunk_size, shard)


def _check_tensors(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            "expected hidden [n, h], weight [V/tp, h] and labels [n]; got shapes "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"labels {tuple(labels.shape)} (need hidden [n, h], weight [V/tp, h], labels [n])"
        )
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating point; got {hidden.dtype} and {weight.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids; got {labels.dtype}")
    if not hidden.device == weight.device == labels.device:
        raise ValueError(
            f"hidden, weight and labels must be on one device; got {hidden.device}, "
            f"{weight.device} and {labels.device}"
        )


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _per_row_temperature(
    temperature: torch.Tensor | float | None, *, n: int, device: torch.device
) -> torch.Tensor | None:
    if temperature is None:
        return None
    if not isinstance(temperature, torch.Tensor):
        if not float(temperature) > 0:
            raise ValueError(f"temperature must be positive; got {temperature!r}")
        return torch.full((n,), float(temperature), dtype=torch.float32, device=device)
    if temperature.numel() == 1:
        return temperature.detach().reshape(()).to(device=device, dtype=torch.float32).expand(n)
    if temperature.shape != (n,):
        raise ValueError(f"temperature must be a scalar or a [n] = [{n}] tensor; got {tuple(temperature.shape)}")
    return temperature.detach().to(device=device, dtype=torch.float32)


def _check_values(labels: torch.Tensor, temperature: torch.Tensor | None, *, vocab_size: int) -> None:
    """Range checks on device values, with a single host synchronisation."""
    if labels.numel() == 0:
        return
    flags = [((labels < 0) | (labels >= vocab_size)).any()]
    if temperature is not None:
        flags.append(~(temperature > 0).all())
    bad = torch.stack(flags).tolist()
    if bad[0]:
        raise ValueError(
            f"labels must be token ids in [0, vocab_size={vocab_size}); got values in "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    if len(bad) > 1 and bad[1]:
        raise ValueError("temperature must be positive (and not NaN) for every row")


class _VocabParallelLogprobs(torch.autograd.Function):
    """Saves hidden, weight, labels, temperature and the per-row lse; nothing of size n x V."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, shard):
        x = hidden.to(weight.dtype)
        local_max, local_sumexp, target = _local_stats(x, weight, labels, temperature, chunk_size, shard)
        lse, target = _combine_over_ranks(local_max, local_sumexp, target, shard.group)
        ctx.save_for_backward(x, weight, labels, temperature, lse)
        ctx.hidden_dtype = hidden.dtype
        ctx.chunk_size = chunk_size
        ctx.shard = shard
        return target - lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, labels, temperature, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        scale = grad_out.float() if temperature is None else grad_out.float() / temperature
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_hidden else None
        grad_weight = None
        if need_weight:  # every valid row is written once below; padding rows get zeros
            grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            grad_weight[ctx.shard.valid_rows :].zero_()
        neg_scale = scale.neg().unsqueeze(1)
        for start, stop in _blocks(ctx.shard.valid_rows, ctx.chunk_size):
            w = weight[start:stop]
            grad_logits = _logits(x, w, temperature).sub_(lse.unsqueeze(1)).exp_()  # softmax
            grad_logits.mul_(neg_scale)  # -softmax * grad / T
            in_block, column = _label_columns(labels, ctx.shard.start + start, stop - start)
            onehot = torch.where(in_block, scale, 0.0).unsqueeze(1)
            grad_logits.scatter_add_(1, column.unsqueeze(1), onehot)  # + onehot * grad / T
            grad_logits = grad_logits.to(weight.dtype)
            if need_hidden and grad_logits.dtype == torch.float32:
                grad_x.addmm_(grad_logits, w)
            elif need_hidden:
                grad_x.add_(grad_logits @ w)
            if need_weight:
                torch.mm(grad_logits.t(), x, out=grad_weight[start:stop])
        if need_hidden:
            _all_reduce(grad_x, ctx.shard.group, dist.ReduceOp.SUM)
            grad_x = grad_x.to(ctx.hidden_dtype)
        return grad_x, grad_weight, None, None, None, None


def _blocks(rows: int, chunk_size: int):
    """[start, stop) ranges of local weight rows, ``chunk_size`` at a time."""
    for start in range(0, rows, chunk_size):
        yield start, min(start + chunk_size, rows)


def _logits(x: torch.Tensor, w: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[n, rows]`` logits of one vocabulary block (GEMM in the weight's dtype)."""
    logits = (x @ w.t()).float()
    if temperature is not None:
        logits.div_(temperature.unsqueeze(1))
    return logits


def _label_columns(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows' labels fall in global ids ``[start, start + width)``, and their column there.

    Columns of rows outside the block are clamped into range; callers mask them with ``in_block``
    (no data-dependent indexing, so no host synchronisation).
    """
    column = labels - start
    in_block = (column >= 0) & (column < width)
    return in_block, column.clamp(0, width - 1)


def _local_stats(x, weight, labels, temperature, chunk_size, shard):
    """Per-row max, sum of exp(logit - max) and target logit over this rank's valid rows."""
    n = x.shape[0]
    running_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    sumexp = torch.zeros(n, dtype=torch.float32, device=x.device)
    target = torch.zeros(n, dtype=torch.float32, device=x.device)
    for start, stop in _blocks(shard.valid_rows, chunk_size):
        logits = _logits(x, weight[start:stop], temperature)
        in_block, column = _label_columns(labels, shard.start + start, stop - start)
        target += torch.where(in_block, logits.gather(1, column.unsqueeze(1)).squeeze(1), 0.0)
        new_max = torch.maximum(running_max, logits.amax(dim=1))
        sumexp.mul_(torch.exp(running_max - new_max))
        sumexp += logits.sub_(new_max.unsqueeze(1)).exp_().sum(dim=1)
        running_max = new_max
    return running_max, sumexp, target


def _combine_over_ranks(local_max, local_sumexp, target, group):
    """Global per-row log-sum-exp and target logit from every rank's local statistics."""
    if group is None or local_max.numel() == 0:
        return local_max + torch.log(local_sumexp), target
    global_max = local_max.clone()
    _all_reduce(global_max, group, dist.ReduceOp.MAX)
    # A rank whose shard is all padding has max -inf and sum-exp 0: it contributes 0 here.
    sums = torch.stack([local_sumexp * torch.exp(local_max - global_max), target])
    _all_reduce(sums, group, dist.ReduceOp.SUM)
    return global_max + torch.log(sums[0]), sums[1]


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> None:
    if group is not None and tensor.numel() > 0:
        dist.all_reduce(tensor, op=op, group=group)
