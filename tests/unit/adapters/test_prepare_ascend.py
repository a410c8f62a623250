"""``prepare_ascend``'s refusals, in this process (each one fires before anything is imported).

The successful path and the real "imported too late" case run in fresh interpreters in
``test_ascend_subprocess.py``.
"""

from __future__ import annotations

import sys
import types

import pytest

import megatron_prune.patches as patches_pkg
from megatron_prune import accelerator as acc_mod
from megatron_prune.accelerator import MINDSPEED_ADAPTOR, AcceleratorError
from megatron_prune.adapters import mindspeed as adapter


def _installed(monkeypatch, *names: str) -> None:
    monkeypatch.setattr(acc_mod, "_has_module", lambda name: name in names)


def _forbid_imports(monkeypatch):
    def fail(module, package):
        raise AssertionError(f"prepare_ascend imported {module} before refusing")

    monkeypatch.setattr(adapter, "_import", fail)


def test_missing_torch_npu_names_the_package(monkeypatch):
    _installed(monkeypatch)
    _forbid_imports(monkeypatch)
    with pytest.raises(AcceleratorError, match="package torch_npu") as info:
        adapter.prepare_ascend()
    assert "set_env.sh" in str(info.value)
    assert not adapter.ascend_state()["prepared"]


def test_missing_torch_npu_on_this_machine():
    if acc_mod._has_module("torch_npu"):
        pytest.skip("torch_npu is installed here")
    with pytest.raises(AcceleratorError, match="package torch_npu"):
        adapter.prepare_ascend()


def test_missing_mindspeed_names_the_package(monkeypatch):
    _installed(monkeypatch, "torch_npu")
    _forbid_imports(monkeypatch)
    with pytest.raises(AcceleratorError, match=r"MindSpeed \(import name mindspeed\)") as info:
        adapter.prepare_ascend()
    assert "core_r0.16.0" in str(info.value)


def test_pypi_placeholder_is_refused(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed")
    _forbid_imports(monkeypatch)
    with pytest.raises(AcceleratorError, match="empty PyPI placeholder"):
        adapter.prepare_ascend()


def test_megatron_already_imported(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    _forbid_imports(monkeypatch)
    monkeypatch.delitem(sys.modules, MINDSPEED_ADAPTOR, raising=False)
    if "megatron.core" not in sys.modules:
        monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    with pytest.raises(AcceleratorError, match="imported too late"):
        adapter.prepare_ascend()


def test_cpu_patches_applied_in_this_process(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    _forbid_imports(monkeypatch)
    fake = types.SimpleNamespace(name="cpu.get_default_causal_mask")
    monkeypatch.setattr(patches_pkg, "registered", lambda group=None: [fake] if group == "cpu" else [])
    monkeypatch.setattr(patches_pkg, "is_applied", lambda name: True)
    with pytest.raises(AcceleratorError, match="CPU patches are applied"):
        adapter.prepare_ascend()


def test_failed_torch_npu_import_is_explained(monkeypatch):
    _installed(monkeypatch, "torch_npu", "mindspeed", MINDSPEED_ADAPTOR)
    monkeypatch.delitem(sys.modules, MINDSPEED_ADAPTOR, raising=False)
    monkeypatch.setattr(acc_mod, "megatron_modules", lambda modules=None: [])
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    with pytest.raises(AcceleratorError, match=r"importing torch_npu \(package torch_npu\) failed") as info:
        adapter.prepare_ascend()
    assert "CANN" in str(info.value)
