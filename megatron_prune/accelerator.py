"""The one place that knows cuda / npu / cpu.

Device, distributed backend, synchronisation, seeding and peak-memory statistics. Every other
module asks :func:`get_accelerator` instead of calling ``torch.cuda`` directly.

``--device npu`` also checks the Ascend stack (torch_npu and MindSpeed installed, MindSpeed's
adaptor loaded before Megatron); :mod:`megatron_prune.adapters.mindspeed` sets that stack up.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

KINDS = ("cuda", "npu", "cpu")
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}

MINDSPEED_ADAPTOR = "mindspeed.megatron_adaptor"
"""MindSpeed's entry point: importing it patches Megatron for the NPU (``patch_features()``)."""
MINDSPEED_PATCH_UTILS = "mindspeed.patch_utils"
"""Loaded by MindSpeed before it can patch anything; it imports nothing of Megatron."""
TRANSFER_TO_NPU = "torch_npu.contrib.transfer_to_npu"
"""torch_npu's shim that redirects ``torch.cuda`` to the NPU (imported by MindSpeed's adaptor)."""

_TORCH_NPU_HINT = (
    "install the torch_npu wheel that matches your torch and CANN versions "
    "(https://gitee.com/ascend/pytorch/releases) and source CANN's set_env.sh"
)
_MINDSPEED_HINT = (
    "install MindSpeed from source, from the branch that matches your Megatron-Core "
    "(git clone -b core_r0.16.0 https://gitee.com/ascend/MindSpeed.git && pip install -e MindSpeed); "
    "the PyPI package 'mindspeed' is an empty placeholder"
)


class AcceleratorError(RuntimeError):
    """``--device`` names an accelerator this process cannot use, or its stack is set up wrongly."""


def _has_module(name: str) -> bool:
    """True when ``name`` can be imported (its parent packages are imported to find out)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # parent missing, or a module without a spec in sys.modules
        return name in sys.modules


def require_torch_npu() -> None:
    """Raise :class:`AcceleratorError` naming torch_npu when it is not installed."""
    if not _has_module("torch_npu"):
        raise AcceleratorError(f"--device npu needs the package torch_npu, which is not installed: {_TORCH_NPU_HINT}")


def require_mindspeed() -> None:
    """Raise :class:`AcceleratorError` naming MindSpeed when it (or its Megatron adaptor) is missing."""
    if not _has_module("mindspeed"):
        raise AcceleratorError(f"--device npu needs the package MindSpeed (import name mindspeed), which is not installed: {_MINDSPEED_HINT}")
    if not _has_module(MINDSPEED_ADAPTOR):
        raise AcceleratorError(
            f"the installed 'mindspeed' has no {MINDSPEED_ADAPTOR} (is it the empty PyPI placeholder?): {_MINDSPEED_HINT}"
        )


def megatron_modules(modules: Mapping[str, object] | None = None) -> list[str]:
    """Loaded Megatron modules (``megatron.core``, ``megatron.training``, ...), in the order their imports finished."""
    modules = sys.modules if modules is None else modules
    return [name for name in modules if name.startswith("megatron.")]


def check_import_order(modules: Mapping[str, object] | None = None) -> None:
    """Raise when Megatron was imported before MindSpeed's adaptor could patch it.

    Without the adaptor, any loaded ``megatron.*`` module is too early. With it, note that
    CPython moves a module to the end of ``sys.modules`` when its import *finishes*, so the
    adaptor itself always comes after the Megatron modules it imports while patching; the
    reference point is :data:`MINDSPEED_PATCH_UTILS`, which is finished before MindSpeed
    imports any Megatron module. A Megatron module finished before it was imported first.
    """
    modules = sys.modules if modules is None else modules
    loaded = megatron_modules(modules)
    if not loaded:
        return
    names = list(modules)
    if (
        MINDSPEED_ADAPTOR in modules
        and MINDSPEED_PATCH_UTILS in modules
        and names.index(MINDSPEED_PATCH_UTILS) < names.index(loaded[0])
    ):
        return
    raise AcceleratorError(
        f"Megatron was imported too late for the NPU: {loaded[0]} was imported before "
        f"{MINDSPEED_ADAPTOR}, so modules that did 'from megatron... import f' keep the unpatched "
        "CUDA functions. Call megatron_prune.adapters.mindspeed.prepare_ascend() (the trainers do "
        "it for --device npu) before anything imports megatron, in a fresh process."
    )


_NPU_STACK_READY = False


def mark_npu_stack_ready() -> None:
    """Called by ``prepare_ascend`` once MindSpeed's adaptor is loaded (it checked the order on entry)."""
    global _NPU_STACK_READY
    _NPU_STACK_READY = True


def check_npu_stack(modules: Mapping[str, object] | None = None) -> None:
    """The checks behind ``--device npu``: torch_npu and MindSpeed installed, adaptor loaded first."""
    modules = sys.modules if modules is None else modules
    if _NPU_STACK_READY and modules is sys.modules:
        return
    require_torch_npu()
    require_mindspeed()
    check_import_order(modules)
    if MINDSPEED_ADAPTOR not in modules:
        raise AcceleratorError(
            f"--device npu: MindSpeed's Megatron adaptor ({MINDSPEED_ADAPTOR}) is not loaded; call "
            "megatron_prune.adapters.mindspeed.prepare_ascend() before anything imports megatron"
        )


def npu_available() -> bool:
    """True when torch_npu is installed and sees an NPU (imports torch_npu to find out)."""
    if not _has_module("torch_npu"):
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def require_visible_npu() -> None:
    """Raise :class:`AcceleratorError` when torch_npu sees no NPU (imports torch_npu)."""
    if not npu_available():
        raise AcceleratorError(
            "--device npu was requested but torch_npu sees no NPU (torch.npu.is_available() is False); "
            "check ASCEND_RT_VISIBLE_DEVICES, the driver (npu-smi info) and CANN's set_env.sh"
        )


def detect_kind(requested: str = "auto") -> str:
    """Resolve ``--device`` (auto, cuda, npu, cpu) to a kind, or raise a clear error.

    ``auto`` prefers an NPU, then a CUDA GPU, then the CPU. The NPU is checked first because
    MindSpeed imports ``torch_npu.contrib.transfer_to_npu``, after which ``torch.cuda`` reports
    the NPUs. Resolving to ``npu`` (asked for or detected) also runs :func:`check_npu_stack`.
    """
    if requested not in ("auto",) + KINDS:
        raise ValueError(f"--device must be one of auto, cuda, npu, cpu; got {requested!r}")
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        _check_cuda()
        return "cuda"
    if requested == "npu":
        require_torch_npu()
        require_visible_npu()
        check_npu_stack()
        return "npu"
    if npu_available():
        check_npu_stack()
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _check_cuda() -> None:
    if TRANSFER_TO_NPU in sys.modules:
        raise AcceleratorError(
            f"--device cuda was requested but {TRANSFER_TO_NPU} (imported by MindSpeed) redirects "
            "torch.cuda to the NPU in this process; use --device npu"
        )
    if not torch.cuda.is_available():
        raise AcceleratorError("--device cuda was requested but torch.cuda.is_available() is False")


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
    def process_group_backend(self) -> str:
        """What the world process group is started with: the device's backend for device tensors
        and gloo for host tensors (the trainers reduce metrics, counts and flags as CPU tensors,
        which an nccl- or hccl-only group refuses); plain gloo on CPU."""
        return "gloo" if self.kind == "cpu" else f"cpu:gloo,{self.kind}:{self.backend}"

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

    def release_cached_memory(self) -> None:
        """Hand memory held by freed tensors back to the system before a peak-memory window.

        On CPU glibc keeps the pages of freed tensors resident, so a window that reuses them never
        raises RSS and its peak above the current RSS reads too low; trimming the heap makes
        RSS track live tensors. On GPU/NPU the allocator peak does not depend on the cache, so
        this is a no-op there. It costs page faults afterwards: call it outside timed regions.
        """
        if self.module is None:
            _malloc_trim()

    def track_live_memory(self) -> bool:
        """From now on let CPU RSS follow live tensors (for memory-measurement phases only).

        glibc serves every allocation of 64 KiB or more by its own mmap and unmaps it on free, so
        the peak RSS of a window is the peak of live tensors plus small-object noise, not heap
        fragmentation. The price is a page fault per fresh page of every large tensor: do not time
        what runs after this. Returns False where it cannot (not glibc); a no-op on GPU/NPU.
        """
        if self.module is not None:
            return True
        return _mallopt_mmap_threshold(64 * 1024)

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


@functools.cache
def _glibc():
    """glibc's handle, or None where the C library is another (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def _mallopt_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of ``nbytes`` and more by mmap, so free() returns them at once (glibc)."""
    libc = _glibc()
    return bool(libc and libc.mallopt(-3, nbytes))  # -3 = M_MMAP_THRESHOLD


def _malloc_trim() -> None:
    """Return the C heap's free pages to the OS (glibc only; a no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


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


def _npu_stack_loaded() -> bool:
    """Whether this process loaded MindSpeed's adaptor before Megatron (the checks of ``--device npu``)."""
    try:
        check_npu_stack()
    except AcceleratorError:
        return False
    return True


def get_accelerator() -> Accelerator:
    """The accelerator chosen by :func:`set_accelerator`, auto-detected on first use.

    A process that chose none (the converters, a library caller) gets an NPU only where MindSpeed
    has been loaded in the right order (the trainers do that before importing Megatron, a library
    caller may have done it itself); on an NPU host without that it runs on CUDA or the CPU, instead
    of stopping at the import-order check it cannot pass."""
    global _CURRENT
    if _CURRENT is None:
        if _NPU_STACK_READY or not npu_available() or _npu_stack_loaded():
            _CURRENT = Accelerator(detect_kind("auto"))
        elif TRANSFER_TO_NPU not in sys.modules and torch.cuda.is_available():
            _CURRENT = Accelerator("cuda")
        else:
            _CURRENT = Accelerator("cpu")
    return _CURRENT
