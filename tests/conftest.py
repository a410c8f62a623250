"""Shared fixtures: GPU skip, temporary directories; Ctrl-C as Python handles it."""

from __future__ import annotations

import signal

import pytest
import torch


def pytest_configure(config):
    # A shell without job control starts background commands with SIGINT ignored, and every
    # process the tests start would inherit that; the Ctrl-C tests need Python's own handler.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
