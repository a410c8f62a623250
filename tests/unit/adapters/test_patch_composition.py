"""Our patches compose with MindSpeed's patch manager: both sets hold, in a known order.

Runs against the stand-in ``MindSpeedPatchesManager`` (``standin/mindspeed/patch_utils.py``,
written for these tests from MindSpeed's documented semantics, see standin/README.md) and, when
``MEGATRON_PRUNE_MINDSPEED_SRC`` points at a MindSpeed checkout, against MindSpeed's real
``mindspeed/patch_utils.py`` too (it imports without torch_npu). The targets are a small fake
module tree, so no Megatron import is needed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import pytest

from megatron_prune.adapters import mindspeed as adapter
from megatron_prune.patches import Patch, mindspeed_compat
from megatron_prune.patches.registry import PATCH_MARK

from .conftest import REAL_SRC_ENV, STANDIN, real_mindspeed_src

FAKE = "mp_fake_megatron"
FUNC_TARGET = f"{FAKE}.utils.get_value"
METHOD_TARGET = f"{FAKE}.attention.DotProductAttention.forward"


@pytest.fixture(params=["standin", "real"])
def manager(request):
    """A fresh MindSpeedPatchesManager class (its registry is a class attribute)."""
    if request.param == "standin":
        path = STANDIN / "mindspeed" / "patch_utils.py"
    else:
        src = real_mindspeed_src()
        if src is None:
            pytest.skip(f"set {REAL_SRC_ENV} to a MindSpeed checkout to run against its real patch_utils.py")
        path = src / "mindspeed" / "patch_utils.py"
    name = f"_mp_patch_utils_{request.param}_{id(request)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = module.MindSpeedPatchesManager
    cls.patches_info = {}
    yield cls
    cls.remove_patches()


@pytest.fixture
def fake_megatron(monkeypatch):
    """``mp_fake_megatron.utils.get_value`` (aliased by ``.user``) and ``.attention.DotProductAttention``."""
    pkg = types.ModuleType(FAKE)
    pkg.__path__ = []
    utils = types.ModuleType(f"{FAKE}.utils")
    user = types.ModuleType(f"{FAKE}.user")
    attention = types.ModuleType(f"{FAKE}.attention")

    def get_value():
        return ["megatron"]

    class DotProductAttention:
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            return {"impl": "megatron", "packed_seq_params": packed_seq_params}

    utils.get_value = get_value
    user.get_value = get_value  # `from mp_fake_megatron.utils import get_value`
    attention.DotProductAttention = DotProductAttention
    pkg.utils, pkg.user, pkg.attention = utils, user, attention
    for module in (pkg, utils, user, attention):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return types.SimpleNamespace(utils=utils, user=user, attention=attention, original=get_value)


def _tagging_patch(name: str, target: str, tag: str) -> Patch:
    """A plugin patch (not registered in the registry) that appends ``tag`` to the result."""

    def build(original):
        def replacement(*args, **kwargs):
            return original(*args, **kwargs) + [tag]

        return replacement

    return Patch(name=name, target=target, reason="test", build=build, group="test")


def _mindspeed_replacement():
    return ["mindspeed"]


def mindspeed_tag_wrapper(fn):  # a MindSpeed decorator-style patch: name ends in "wrapper"
    def inner(*args, **kwargs):
        return fn(*args, **kwargs) + ["mindspeed-wrapper"]

    return inner


def _register_ours(manager, *patches):
    return adapter.register_patches_with(manager, list(patches))


def test_ours_wraps_mindspeeds_replacement_and_wrapper(manager, fake_megatron):
    manager.register_patch(FUNC_TARGET, _mindspeed_replacement)
    manager.register_patch(FUNC_TARGET, mindspeed_tag_wrapper)
    manager.apply_patches()  # MindSpeed's adaptor has run
    _register_ours(manager, _tagging_patch("t.ours", FUNC_TARGET, "ours"))
    manager.apply_patches()
    expected = ["mindspeed", "mindspeed-wrapper", "ours"]
    assert fake_megatron.utils.get_value() == expected
    assert fake_megatron.user.get_value() == expected  # the `from ... import` alias follows
    assert getattr(fake_megatron.utils.get_value, PATCH_MARK) == "t.ours"


def test_ours_registered_in_the_same_pass(manager, fake_megatron):
    # As the plugin's feature does: registered after MindSpeed's features, applied once.
    manager.register_patch(FUNC_TARGET, _mindspeed_replacement)
    _register_ours(manager, _tagging_patch("t.ours", FUNC_TARGET, "ours"))
    manager.apply_patches()
    assert fake_megatron.user.get_value() == ["mindspeed", "ours"]


def test_ours_on_a_target_mindspeed_leaves_alone(manager, fake_megatron):
    _register_ours(manager, _tagging_patch("t.ours", FUNC_TARGET, "ours"))
    manager.apply_patches()
    assert fake_megatron.utils.get_value() == ["megatron", "ours"]


def test_registering_twice_wraps_once(manager, fake_megatron):
    patch = _tagging_patch("t.ours", FUNC_TARGET, "ours")
    _register_ours(manager, patch)
    _register_ours(manager, patch)
    manager.apply_patches()
    manager.apply_patches()
    assert fake_megatron.utils.get_value() == ["megatron", "ours"]


def test_a_later_mindspeed_wrapper_goes_outside(manager, fake_megatron):
    manager.register_patch(FUNC_TARGET, _mindspeed_replacement)
    _register_ours(manager, _tagging_patch("t.ours", FUNC_TARGET, "ours"))
    manager.register_patch(FUNC_TARGET, mindspeed_tag_wrapper)
    manager.apply_patches()
    assert fake_megatron.utils.get_value() == ["mindspeed", "ours", "mindspeed-wrapper"]


def test_remove_and_repatch_keeps_both(manager, fake_megatron):
    # MindSpeed's repatch(): remove_patches(), then every feature registers again and applies.
    def register_all():
        manager.register_patch(FUNC_TARGET, _mindspeed_replacement)
        _register_ours(manager, patch)
        manager.apply_patches()

    patch = _tagging_patch("t.ours", FUNC_TARGET, "ours")
    register_all()
    manager.remove_patches()
    assert fake_megatron.utils.get_value() == ["megatron"]
    assert fake_megatron.user.get_value() == ["megatron"]
    register_all()
    assert fake_megatron.user.get_value() == ["mindspeed", "ours"]


def test_plain_setattr_is_lost_when_mindspeed_reapplies(manager, fake_megatron):
    """Negative control: why our patches go through MindSpeed's manager."""
    manager.register_patch(FUNC_TARGET, _mindspeed_replacement)
    manager.apply_patches()
    current = fake_megatron.utils.get_value
    fake_megatron.utils.get_value = lambda: current() + ["ours"]  # plain setattr after MindSpeed
    assert fake_megatron.utils.get_value() == ["mindspeed", "ours"]
    manager.register_patch(FUNC_TARGET, mindspeed_tag_wrapper)  # e.g. a later feature
    manager.apply_patches()
    assert fake_megatron.utils.get_value() == ["mindspeed", "mindspeed-wrapper"]


class _Params:
    """Stand-in for Megatron's PackedSeqParams (the same field names); the real class is used in
    test_packed_thd.py."""

    def __init__(self, cu, padded=None):
        self.qkv_format = "thd"
        self.cu_seqlens_q = self.cu_seqlens_kv = cu
        self.cu_seqlens_q_padded = self.cu_seqlens_kv_padded = padded


def _mindspeed_fusion_attention(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
    """What MindSpeed's TND path hands npu_fusion_attention: ``cu_seqlens_q.tolist()``, unchecked."""
    return {"impl": "mindspeed", "actual_seq_qlen": packed_seq_params.cu_seqlens_q.tolist()}


def test_thd_patch_converts_cu_seqlens_for_mindspeeds_attention(manager, fake_megatron):
    import torch

    ours = dataclasses.replace(adapter._plugin_patches()[0], target=METHOD_TARGET)
    manager.register_patch(METHOD_TARGET, _mindspeed_fusion_attention)
    manager.apply_patches()
    _register_ours(manager, ours)
    manager.apply_patches()
    attn = fake_megatron.attention.DotProductAttention()
    params = _Params(torch.tensor([0, 3, 7, 10], dtype=torch.int32))
    out = attn.forward(None, None, None, None, attn_mask_type=None, attention_bias=None, packed_seq_params=params)
    assert out == {"impl": "mindspeed", "actual_seq_qlen": [3, 7, 10]}
    out = attn.forward(None, None, None, None, None, None, params)  # positional, as some callers do
    assert out["actual_seq_qlen"] == [3, 7, 10]
    assert params.cu_seqlens_q.tolist() == [0, 3, 7, 10]  # the caller's object is not modified
    already_npu = _Params(torch.tensor([3, 7, 10], dtype=torch.int32))
    assert attn.forward(None, None, None, None, packed_seq_params=already_npu)["actual_seq_qlen"] == [3, 7, 10]
    inner = fake_megatron.attention.DotProductAttention.forward.__wrapped__
    assert inner is _mindspeed_fusion_attention


def test_plugin_patch_group_is_the_registered_one():
    names = [p.name for p in adapter._plugin_patches()]
    assert names == ["mindspeed.DotProductAttention.forward.thd_cu_seqlens"]
    assert all(p.group == mindspeed_compat.GROUP for p in adapter._plugin_patches())


def test_wrappers_are_named_for_mindspeed():
    wrapper = adapter._as_mindspeed_wrapper(adapter._plugin_patches()[0])
    assert wrapper.__name__.endswith("wrapper") and wrapper.__name__.isidentifier()
    assert adapter._as_mindspeed_wrapper(adapter._plugin_patches()[0]) is wrapper
