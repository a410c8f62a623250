"""One optimizer step on Megatron's pipeline schedules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func


@dataclass
class StepResult:
    """What one step produced, identical on every rank."""

    metrics: dict[str, float] = field(default_factory=dict)
    """Per-step metrics averaged over microbatches (and summed where the loss function says so)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping (None for forward-only steps)."""
    skipped: bool = False
    """True when the optimizer refused the step (non-finite gradients)."""


def run_schedule(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator | list[Iterator],
    model: list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Run Megatron's forward(-backward) schedule; return the last stage's per-microbatch outputs."""
    forward_backward = get_forward_backward_func()
    if len(model) > 1 and not isinstance(data_iterator, list):
        data_iterator = [data_iterator] * len(model)
    return forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def reduce_metrics(outputs: list[dict[str, Any]]) -> dict[str, float]:
    """Average per-microbatch metric dicts over microbatches and DP; broadcast from the last stage.

    Each value is a tensor ``[sum, count]`` (averaged as sum/count) or a scalar (plain mean).
    """
    names = sorted(outputs[0]) if outputs else []
    totals = torch.zeros(len(names), 2, dtype=torch.float64)
    for out in outputs:
        for i, name in enumerate(names):
            v = torch.as_tensor(out[name], dtype=torch.float64).detach().cpu().reshape(-1)
            totals[i] += v if v.numel() == 2 else torch.stack([v[0], torch.ones((), dtype=torch.float64)])
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and names:
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    # Everyone learns the metric names and values from the last stage's first rank.
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    payload = [names, totals] if dist.get_rank() == src else [None, None]
    dist.broadcast_object_list(payload, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    names, totals = payload
    return {n: float(totals[i, 0] / totals[i, 1]) for i, n in enumerate(names)}


def forward_backward(
    *,
    model: list[torch.nn.Module],
    optimizer,
    **schedule_kwargs,
) -> list[dict[str, Any]]:
    """Zero grads and accumulate this step's gradients (reduced over DP/TP/embedding groups)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    return run_schedule(model=model, forward_only=False, **schedule_kwargs)


def train_step(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator | list[Iterator],
    model: list[torch.nn.Module],
    optimizer,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
) -> StepResult:
    """Zero grads, run forward/backward over the microbatches, step the optimizer."""
    outputs = forward_backward(
        model=model,
        optimizer=optimizer,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
    )
    success, grad_norm, _ = optimizer.step()
    return StepResult(metrics=reduce_metrics(outputs), grad_norm=grad_norm, skipped=not success)
