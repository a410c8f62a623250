"""tools/memory_at_peak.py: the allocator peak of a profiled region and what is live at it."""

from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

from memory_at_peak import format_live_at_peak, live_at_peak  # noqa: E402

MiB = 2**20


def test_peak_and_live_groups_follow_the_allocation_order():
    older = torch.empty(MiB // 4)  # allocated before the region: freeing it inside is ignored
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("phase:first"):
            a = torch.empty(MiB // 4)  # 1 MiB, freed before the peak
            b = torch.empty(MiB // 2)  # 2 MiB, live at the peak
            del a, older
        with record_function("phase:second"):
            x = torch.ones(256, 1024, requires_grad=True)  # 1 MiB
            (x * 3).sum().backward()  # x.grad: 1 MiB allocated by autograd's engine
            c = torch.empty(MiB)  # 4 MiB: the peak is b + x + x.grad + c
        del c
    peak, groups = live_at_peak(prof)
    assert peak == 8 * MiB
    found = dict(groups)
    assert found["first forward aten::empty"] == 2 * MiB
    assert found["second forward aten::ones"] == MiB
    assert found["second forward aten::empty"] == 4 * MiB
    assert sum(size for label, size in groups if label.startswith("second backward")) == MiB
    assert sum(found.values()) == peak
    assert "8.0 MiB" in format_live_at_peak(peak, groups)
    del b, x
