"""``bench_grpo --grad-variance`` counts every weight of a model-parallel run once."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "tools")))

import bench_grpo  # noqa: E402


def _policy():
    chunk = torch.nn.Module()
    chunk.split = torch.nn.Parameter(torch.zeros(3))  # a TP shard: its own part on every TP rank
    chunk.split.tensor_model_parallel = True
    chunk.norm = torch.nn.Parameter(torch.zeros(2))  # replicated over TP: the same gradient everywhere
    chunk.tied = torch.nn.Parameter(torch.zeros(4))  # the last stage's copy of a tied embedding
    chunk.tied.tensor_model_parallel = True
    chunk.tied.shared = True
    chunk.frozen = torch.nn.Parameter(torch.zeros(5), requires_grad=False)
    for i, p in enumerate(chunk.parameters()):
        p.main_grad = torch.full_like(p, float(i + 1))
    return [chunk]


@pytest.mark.parametrize("tp_rank, expected", [(0, [1.0] * 3 + [2.0] * 2), (1, [1.0] * 3)])
def test_replicated_and_tied_weights_count_on_one_rank(tp_rank, expected, monkeypatch):
    """Summing the ranks' squared norms gives the gradient's norm only if a TP-replicated weight
    counts on TP rank 0 alone and the tied embedding's second copy not at all."""
    monkeypatch.setattr("megatron.core.tensor_parallel.layers.get_tensor_model_parallel_rank", lambda: tp_rank)
    assert bench_grpo._flat_grad(_policy()).tolist() == expected
