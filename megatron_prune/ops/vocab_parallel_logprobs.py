"""log p(label) from hidden states and a vocab-parallel output weight.

PLACEHOLDER (materialises n x V/tp logits); replaced by the fused chunked op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(g, group=ctx.group)
        return g, None


def vocab_parallel_logprobs(hidden, weight, labels, *, chunk_size=4096, tp_group=None, vocab_size=None,
                            temperature=None):
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    hidden = _AllReduceBackward.apply(hidden, tp_group)
    logits = (hidden @ weight.t()).float()
    if temperature is not None:
        logits = logits / temperature.unsqueeze(-1)
    v_local = weight.shape[0]
    start = rank * v_local
    if vocab_size is not None:
        ids = torch.arange(start, start + v_local, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    lmax = logits.max(dim=-1).values.detach()
    if tp > 1:
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=tp_group)
    sumexp = torch.exp(logits - lmax.unsqueeze(-1)).sum(-1)
    local = (labels >= start) & (labels < start + v_local)
    idx = (labels - start).clamp(0, v_local - 1)
    tgt = logits.gather(1, idx.unsqueeze(1)).squeeze(1) * local
    if tp > 1:
        sumexp = _AllReduceSum.apply(sumexp, tp_group)
        tgt = _AllReduceSum.apply(tgt, tp_group)
    return tgt - lmax - torch.log(sumexp)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None
