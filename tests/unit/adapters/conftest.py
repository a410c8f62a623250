"""Fixtures of the adapter tests: the accelerator state and the stand-in MindSpeed tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from megatron_prune import accelerator as acc_mod
from megatron_prune.adapters import mindspeed as adapter

STANDIN = Path(__file__).parent / "standin"
REAL_SRC_ENV = "MEGATRON_PRUNE_MINDSPEED_SRC"
"""A MindSpeed checkout (the directory holding ``mindspeed/``) to test against its real files."""

REAL_FILES = (
    "patch_utils.py",
    "args_utils.py",
    "log_config.py",
    "deprecate.py",
    "megatron_adaptor.py",
    "features_manager/feature.py",
    "features_manager/features_manager.py",
)
"""MindSpeed files that import without torch_npu; they replace the stand-ins when REAL_SRC_ENV is set."""


def real_mindspeed_src() -> Path | None:
    src = os.environ.get(REAL_SRC_ENV)
    return Path(src) if src else None


@pytest.fixture(autouse=True)
def fresh_accelerator_state(monkeypatch):
    """Every test starts with no accelerator chosen and nothing prepared, and leaves it so."""
    monkeypatch.setattr(acc_mod, "_CURRENT", None)
    monkeypatch.setattr(acc_mod, "_NPU_STACK_READY", False)
    monkeypatch.setattr(adapter, "_STATE", adapter._AscendState())


@pytest.fixture(params=["standin", "real"])
def mindspeed_tree(request, tmp_path) -> Path:
    """A directory to put on PYTHONPATH: stand-in torch_npu and mindspeed, or MindSpeed's real files."""
    root = tmp_path / "site"
    shutil.copytree(STANDIN, root, ignore=shutil.ignore_patterns("__pycache__", "README.md"))
    if request.param == "real":
        src = real_mindspeed_src()
        if src is None:
            pytest.skip(f"set {REAL_SRC_ENV} to a MindSpeed checkout to run against its real files")
        for name in REAL_FILES:
            shutil.copyfile(src / "mindspeed" / name, root / "mindspeed" / name)
    return root
