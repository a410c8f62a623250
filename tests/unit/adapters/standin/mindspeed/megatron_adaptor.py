"""Test stand-in for ``mindspeed.megatron_adaptor`` (see ../README.md): patches at import."""

from torch_npu.contrib import transfer_to_npu  # noqa: F401

from mindspeed.args_utils import get_mindspeed_args
from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager


def patch_features():
    args = get_mindspeed_args()
    MindSpeedFeaturesManager.apply_features_pre_patches(args)
    MindSpeedFeaturesManager.apply_features_patches(args)


def repatch(args):
    MindSpeedFeaturesManager.remove_patches()
    full = get_mindspeed_args()
    for key, value in args.items():
        setattr(full, key, value)
    MindSpeedFeaturesManager.apply_features_pre_patches(full)
    MindSpeedFeaturesManager.apply_features_patches(full)


patch_features()
