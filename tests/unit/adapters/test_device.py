"""``--device`` resolution, backend mapping and the NPU-stack checks of ``megatron_prune.accelerator``.

Availability is monkeypatched (``npu_available``, ``torch.cuda.is_available``, which packages
``_has_module`` reports); nothing here imports torch_npu, MindSpeed or Megatron.
"""

from __future__ import annotations

import platform
import sys
import types
from collections import OrderedDict

import numpy as np
import pytest
import torch

from megatron_prune import accelerator as acc_mod
from megatron_prune.accelerator import (
    MINDSPEED_ADAPTOR,
    MINDSPEED_PATCH_UTILS as PATCH_UTILS,
    TRANSFER_TO_NPU,
    Accelerator,
    AcceleratorError,
    check_import_order,
    check_npu_stack,
    detect_kind,
    set_accelerator,
)
from megatron_prune.adapters import mindspeed as adapter


def _installed(monkeypatch, *names: str) -> None:
    """Pretend exactly ``names`` are importable (``mindspeed`` implies nothing about its adaptor)."""
    monkeypatch.setattr(acc_mod, "_has_module", lambda name: name in names)


def _hardware(monkeypatch, *, npu: bool, cuda: bool) -> None:
    monkeypatch.setattr(acc_mod, "npu_available", lambda: npu)
    monkeypatch.setattr(adapter, "npu_available", lambda: npu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


@pytest.mark.parametrize(("kind", "backend"), [("cuda", "nccl"), ("npu", "hccl"), ("cpu", "gloo")])
def test_backend_of_each_kind(kind, backend):
    assert Accelerator(kind).backend == backend
    # host tensors (metrics, counts, flags) are reduced over gloo beside the device backend
    assert Accelerator(kind).process_group_backend == ("gloo" if kind == "cpu" else f"cpu:gloo,{kind}:{backend}")


def test_cpu_device_and_no_device_module():
    acc = Accelerator("cpu")
    assert acc.device == torch.device("cpu")
    assert acc.module is None


def test_device_index_is_the_local_rank(monkeypatch):
    """Global rank 9 is local rank 1 on the second node of 8-device nodes: it takes device 1."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "9")
    assert Accelerator("cuda").device == torch.device("cuda", 1)


class _FakeDeviceModule:
    """Stands in for ``torch.cuda``/``torch.npu``: records seeds, reports fixed memory readings."""

    def __init__(self):
        self.seeds = []

    def manual_seed_all(self, seed):
        self.seeds.append(seed)

    def max_memory_allocated(self):
        return 100 * 2**20

    def max_memory_reserved(self):
        return 300 * 2**20

    def memory_allocated(self):
        return 40 * 2**20

    def memory_reserved(self):
        return 200 * 2**20


def _fake_device(monkeypatch) -> _FakeDeviceModule:
    fake = _FakeDeviceModule()
    monkeypatch.setattr(Accelerator, "module", property(lambda self: None if self.kind == "cpu" else fake))
    return fake


def test_manual_seed_seeds_every_device_generator(monkeypatch):
    """--seed must reach the GPU/NPU generators too (dropout masks on the device)."""
    fake = _fake_device(monkeypatch)
    Accelerator("cuda").manual_seed(1234)
    assert fake.seeds == [1234]
    assert torch.initial_seed() == 1234


def test_manual_seed_takes_seeds_beyond_numpys_range():
    """numpy seeds are below 2**32; a larger --seed still seeds it (reduced) instead of crashing."""
    Accelerator("cpu").manual_seed(2**32 + 7)
    drawn = np.random.rand(3)
    np.random.seed(7)
    assert np.array_equal(drawn, np.random.rand(3))


def test_device_memory_readings_count_tensors_not_the_allocator_cache(monkeypatch):
    """Peak and current memory on GPU/NPU are what tensors held, not what the caching allocator reserved."""
    _fake_device(monkeypatch)
    acc = Accelerator("npu")
    assert acc.peak_memory_bytes() == 100 * 2**20
    assert acc.current_memory_bytes() == 40 * 2**20


def test_unknown_device_is_a_value_error():
    with pytest.raises(ValueError, match="auto, cuda, npu, cpu"):
        detect_kind("tpu")


@pytest.mark.parametrize(
    ("npu", "cuda", "expected"),
    [(False, False, "cpu"), (False, True, "cuda")],
)
def test_auto_without_npu(monkeypatch, npu, cuda, expected):
    _hardware(monkeypatch, npu=npu, cuda=cuda)
    assert detect_kind("auto") == expected


@pytest.mark.parametrize("visible", [False, True])
def test_npu_available_asks_torch_npu(monkeypatch, visible):
    """torch_npu installed on a host without an NPU: not available, and auto does not pick it."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: visible), raising=False)
    assert acc_mod.npu_available() is visible
    if not visible:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert detect_kind("auto") == "cpu"


def test_auto_prefers_the_npu_over_cuda(monkeypatch):
    # After MindSpeed imports transfer_to_npu, torch.cuda reports the NPUs: the NPU must win.
    _hardware(monkeypatch, npu=True, cuda=True)
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    monkeypatch.setattr(acc_mod, "_NPU_STACK_READY", True)
    assert detect_kind("auto") == "npu"


def test_auto_on_an_npu_host_without_prepare_is_an_error(monkeypatch):
    _hardware(monkeypatch, npu=True, cuda=False)
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    monkeypatch.delitem(sys.modules, MINDSPEED_ADAPTOR, raising=False)
    with pytest.raises(AcceleratorError, match="prepare_ascend"):
        detect_kind("auto")


def test_cpu_is_always_available(monkeypatch):
    _hardware(monkeypatch, npu=True, cuda=True)
    assert detect_kind("cpu") == "cpu"
    assert set_accelerator("cpu").backend == "gloo"


def test_cuda_requested_without_a_gpu(monkeypatch):
    _hardware(monkeypatch, npu=False, cuda=False)
    with pytest.raises(AcceleratorError, match=r"torch.cuda.is_available\(\) is False"):
        detect_kind("cuda")


def test_cuda_requested_with_a_gpu(monkeypatch):
    _hardware(monkeypatch, npu=False, cuda=True)
    assert detect_kind("cuda") == "cuda"


def test_cuda_requested_after_transfer_to_npu(monkeypatch):
    _hardware(monkeypatch, npu=True, cuda=True)
    monkeypatch.setitem(sys.modules, TRANSFER_TO_NPU, types.ModuleType(TRANSFER_TO_NPU))
    with pytest.raises(AcceleratorError, match="use --device npu"):
        detect_kind("cuda")


def test_npu_requested_without_torch_npu(monkeypatch):
    _installed(monkeypatch)
    with pytest.raises(AcceleratorError, match="package torch_npu") as info:
        detect_kind("npu")
    assert "CANN" in str(info.value)


def test_npu_requested_without_torch_npu_really_installed():
    # This machine has no torch_npu: no monkeypatching needed for the first check.
    if acc_mod._has_module("torch_npu"):
        pytest.skip("torch_npu is installed here")
    with pytest.raises(AcceleratorError, match="package torch_npu"):
        detect_kind("npu")


def test_npu_requested_with_no_visible_npu(monkeypatch):
    _installed(monkeypatch, "torch_npu")
    _hardware(monkeypatch, npu=False, cuda=False)
    with pytest.raises(AcceleratorError, match="sees no NPU"):
        detect_kind("npu")


def test_npu_requested_without_mindspeed(monkeypatch):
    _installed(monkeypatch, "torch_npu")
    _hardware(monkeypatch, npu=True, cuda=False)
    with pytest.raises(AcceleratorError, match=r"MindSpeed \(import name mindspeed\)") as info:
        detect_kind("npu")
    assert "placeholder" in str(info.value)


def test_npu_requested_with_the_pypi_placeholder(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed")  # a 'mindspeed' without megatron_adaptor
    _hardware(monkeypatch, npu=True, cuda=False)
    with pytest.raises(AcceleratorError, match="empty PyPI placeholder"):
        detect_kind("npu")


def test_npu_requested_when_megatron_came_first(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    _hardware(monkeypatch, npu=True, cuda=False)
    monkeypatch.delitem(sys.modules, MINDSPEED_ADAPTOR, raising=False)
    if "megatron.core" not in sys.modules:
        monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    with pytest.raises(AcceleratorError, match="imported too late"):
        detect_kind("npu")


def test_npu_stack_ready_after_prepare(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    _hardware(monkeypatch, npu=True, cuda=False)
    monkeypatch.setattr(acc_mod, "_NPU_STACK_READY", True)
    assert detect_kind("npu") == "npu"
    assert set_accelerator("npu").backend == "hccl"


def _modules(*names: str) -> OrderedDict:
    return OrderedDict((name, object()) for name in names)


def test_import_order_nothing_loaded():
    check_import_order(_modules("torch", "numpy", "megatron"))  # the bare namespace package holds nothing


def test_import_order_adaptor_first():
    # sys.modules is in order of *finished* imports: the adaptor finishes after the Megatron
    # modules it imported while patching; mindspeed.patch_utils finished before any of them.
    check_import_order(
        _modules("torch_npu", TRANSFER_TO_NPU, PATCH_UTILS, "megatron.core.utils", "megatron.core", MINDSPEED_ADAPTOR)
    )


@pytest.mark.parametrize(
    "names",
    [
        ("megatron.core", "torch_npu", PATCH_UTILS, MINDSPEED_ADAPTOR),
        ("megatron.core",),
        ("torch_npu", PATCH_UTILS, "megatron.core"),
        ("torch_npu", "megatron.training", PATCH_UTILS, "megatron.core", MINDSPEED_ADAPTOR),
    ],
)
def test_import_order_megatron_first(names):
    with pytest.raises(AcceleratorError, match="imported too late") as info:
        check_import_order(_modules(*names))
    assert "prepare_ascend" in str(info.value)


def test_npu_stack_without_the_adaptor(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    with pytest.raises(AcceleratorError, match="adaptor .* is not loaded"):
        check_npu_stack(_modules("torch", "torch_npu"))


def test_npu_stack_complete(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    check_npu_stack(_modules("torch_npu", TRANSFER_TO_NPU, PATCH_UTILS, "megatron.core", MINDSPEED_ADAPTOR))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], "auto"), (["--device", "npu"], "npu"), (["--lr", "1e-5", "--device=cpu"], "cpu"), (["--dev", "npu"], "auto"),
     (["--device", "tpu"], "auto")],
)
def test_requested_device(argv, expected):
    assert adapter.requested_device(argv) == expected


@pytest.mark.parametrize(
    ("transfer_loaded", "cuda", "expected"), [(True, True, "cpu"), (False, True, "cuda"), (False, False, "cpu")]
)
def test_unprepared_npu_host_falls_back_without_the_redirected_cuda(monkeypatch, transfer_loaded, cuda, expected):
    """A process that chose no device on an NPU host where MindSpeed is not loaded in order (a
    converter) runs on CUDA or the CPU; once transfer_to_npu is imported, torch.cuda reports the
    NPUs, so it must not be taken for a GPU (nccl on an NPU)."""
    _hardware(monkeypatch, npu=True, cuda=cuda)
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    monkeypatch.delitem(sys.modules, MINDSPEED_ADAPTOR, raising=False)
    if transfer_loaded:
        monkeypatch.setitem(sys.modules, TRANSFER_TO_NPU, types.ModuleType(TRANSFER_TO_NPU))
    else:
        monkeypatch.delitem(sys.modules, TRANSFER_TO_NPU, raising=False)
    assert acc_mod.get_accelerator().kind == expected


def test_bootstrap_cpu_prepares_nothing(monkeypatch):
    _hardware(monkeypatch, npu=False, cuda=False)
    assert adapter.bootstrap_device(["--device", "cpu", "--train-iters", "2"]) == "cpu"
    assert acc_mod.get_accelerator().kind == "cpu"
    assert not adapter.ascend_state()["prepared"]


def test_bootstrap_auto_on_an_npu_host_prepares_ascend(monkeypatch):
    _hardware(monkeypatch, npu=True, cuda=False)
    called = []
    monkeypatch.setattr(adapter, "prepare_ascend", lambda: called.append(1) or Accelerator("npu"))
    assert adapter.bootstrap_device(["--device", "auto"]) == "npu"
    assert called == [1]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="heap trimming is glibc's malloc_trim")
def test_cpu_release_cached_memory_returns_freed_heap_pages():
    """Without the trim, a peak-memory window would reuse these pages and read too low."""
    acc = acc_mod.Accelerator(kind="cpu")
    blocks = [torch.ones(8192) for _ in range(4096)]  # 128 MiB of 32 KiB heap blocks (below mmap size)
    pin = blocks[1::2]  # every other block stays: the freed ones are holes free() cannot give back
    del blocks
    cached = acc.current_memory_bytes()
    acc.release_cached_memory()
    assert cached - acc.current_memory_bytes() > 32 * 2**20
    acc.reset_peak_memory()
    base = acc.current_memory_bytes()
    grown = torch.ones(2**23)  # 32 MiB touched after the reset
    del grown
    acc.release_cached_memory()  # gone from the RSS now; the window's peak still counts it
    assert acc.current_memory_bytes() - base < 16 * 2**20
    assert acc.peak_memory_bytes() - base >= 31 * 2**20
    del pin
