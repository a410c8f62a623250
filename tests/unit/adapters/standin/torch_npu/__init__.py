"""Test stand-in for torch_npu (see ../README.md): an ``npu`` device type and ``torch.npu``."""

import torch

from . import npu

torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)
