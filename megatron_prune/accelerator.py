"""The one place that knows cuda / npu / cpu.

Device, distributed backend, synchronisation, seeding and peak-memory statistics. Every other
module asks :func:`get_accelerator` instead of calling ``torch.cuda`` directly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

KINDS = ("cuda", "npu", "cpu")
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def detect_kind(requested: str = "auto") -> str:
    """Resolve ``--device`` (auto, cuda, npu, cpu) to a kind, or raise a clear error."""
    if requested not in ("auto",) + KINDS:
        raise ValueError(f"--device must be one of auto, cuda, npu, cpu; got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but torch.cuda.is_available() is False")
    if requested == "npu" and not _npu_available():
        raise RuntimeError(
            "--device npu was requested but torch_npu is not installed or sees no NPU; "
            "install torch_npu and MindSpeed matching your CANN version"
        )
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


@dataclass(frozen=True)
class Accelerator:
    """Device-specific operations for one process."""

    kind: str
    """``cuda``, ``npu`` or ``cpu``."""

    @property
    def backend(self) -> str:
        """torch.distributed backend: nccl, hccl or gloo."""
        return _BACKENDS[self.kind]

    @property
    def device(self) -> torch.device:
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device(self.kind, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def module(self):
        """``torch.cuda`` or ``torch.npu``; None on CPU."""
        return None if self.kind == "cpu" else getattr(torch, self.kind)

    def set_device(self) -> None:
        if self.module is not None:
            self.module.set_device(self.device)

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def manual_seed(self, seed: int) -> None:
        """Seed Python, NumPy, torch and the device generator."""
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        if self.module is not None:
            self.module.manual_seed_all(seed)

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window (allocator peak on GPU/NPU, peak RSS on CPU)."""
        if self.module is not None:
            self.module.reset_peak_memory_stats()
            return
        try:  # Linux: writing 5 resets VmHWM (the peak resident set size) of this process.
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            logger.debug("cannot reset peak RSS; peak memory includes earlier phases")

    def peak_memory_bytes(self) -> int:
        """Peak memory since the last reset: allocator peak on GPU/NPU, VmHWM on CPU."""
        if self.module is not None:
            return int(self.module.max_memory_allocated())
        return _proc_status_bytes("VmHWM")

    def current_memory_bytes(self) -> int:
        """Memory in use now: allocated on GPU/NPU, resident set size on CPU."""
        if self.module is not None:
            return int(self.module.memory_allocated())
        return _proc_status_bytes("VmRSS")


def _proc_status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_CURRENT: Accelerator | None = None


def set_accelerator(requested: str = "auto") -> Accelerator:
    """Choose the accelerator for this process (``--device``)."""
    global _CURRENT
    _CURRENT = Accelerator(detect_kind(requested))
    return _CURRENT


def get_accelerator() -> Accelerator:
    """The accelerator chosen by :func:`set_accelerator`, auto-detected on first use."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Accelerator(detect_kind("auto"))
    return _CURRENT
