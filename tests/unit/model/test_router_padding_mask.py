"""When the selective model hands Megatron's MoE router a padding mask, and when it drops it."""

from __future__ import annotations

import types

import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_prune.model.selective_gpt import SelectiveGPTModel


def _stage(num_moe_experts=4, pre_process=True, sequence_parallel=False):
    return types.SimpleNamespace(
        config=types.SimpleNamespace(num_moe_experts=num_moe_experts, sequence_parallel=sequence_parallel),
        pre_process=pre_process,
    )


def _mask(pad_positions):
    mask = torch.zeros(2, 4, dtype=torch.bool)
    for row, col in pad_positions:
        mask[row, col] = True
    return mask


def test_mask_reaches_the_router_only_where_it_changes_something():
    cpu = torch.device("cpu")
    some = _mask([(1, 3)])
    got = SelectiveGPTModel._router_padding_mask(_stage(), some, cpu)
    assert got is not None and torch.equal(got, some)
    assert SelectiveGPTModel._router_padding_mask(_stage(num_moe_experts=None), some, cpu) is None  # dense
    assert SelectiveGPTModel._router_padding_mask(_stage(), _mask([]), cpu) is None  # no padding
    every = torch.ones(2, 4, dtype=torch.bool)
    assert SelectiveGPTModel._router_padding_mask(_stage(), every, cpu) is None  # a placeholder
    assert SelectiveGPTModel._router_padding_mask(_stage(), None, cpu) is None


def test_a_replaced_gpt_forward_without_the_argument_gets_no_mask(monkeypatch):
    """An accelerator adaptor may replace GPTModel.forward after import; the check must see it."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None):
        raise AssertionError("not called")

    monkeypatch.setattr(GPTModel, "forward", forward)
    assert SelectiveGPTModel._router_padding_mask(_stage(), _mask([(0, 0)]), torch.device("cpu")) is None
