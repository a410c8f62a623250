"""The plugin's flags as declared to MindSpeed, and the trainers' check of MindSpeed's flags."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys

import pytest

from megatron_prune.adapters import mindspeed as adapter
from megatron_prune.arguments import flag_of

from .conftest import STANDIN


def _all_plugin_flags() -> set[str]:
    flags = set()
    for cls in adapter.plugin_config_classes():
        for f in dataclasses.fields(cls):
            flags.add(flag_of(f))
            if "bool_off" in f.metadata:
                flags.add(f.metadata["bool_off"])
    return flags


def test_both_trainers_flags_are_covered():
    modules = {cls.__module__ for cls in adapter.plugin_config_classes()}
    assert "megatron_prune.config" in modules and "megatron_prune.grpo.config" in modules


def test_every_plugin_flag_is_declared():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    added = adapter.add_plugin_flags(parser)
    assert set(added) == _all_plugin_flags()


def test_values_are_typed_and_only_given_flags_appear():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    adapter.add_plugin_flags(parser)
    ns = parser.parse_args(
        ["--prune-position-ratio", "0.3", "--prune-branch", "--data-path", "a", "b", "--no-selective-head", "--device", "npu"]
    )
    assert vars(ns) == {
        "prune_position_ratio": 0.3,
        "prune_branch": True,
        "data_path": ["a", "b"],
        "selective_head": False,
        "device": "npu",
    }


def test_choices_are_enforced():
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    adapter.add_plugin_flags(parser)
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'tpu'"):
        parser.parse_args(["--device", "tpu"])


def test_dests_survive_mindspeeds_transformer_config_wrapper():
    # MindSpeed's TransformerConfig.__init__ wrapper turns every unknown namespace key into a
    # dataclass field with make_dataclass, which needs identifiers: the trainers' dotted dests
    # ("ModelConfig.device") would crash it, the dests declared to MindSpeed must not.
    parser = argparse.ArgumentParser(allow_abbrev=False)
    adapter.add_plugin_flags(parser)
    dests = {action.dest for action in parser._actions if action.dest != "help"}
    assert all(dest.isidentifier() for dest in dests)
    dataclasses.make_dataclass("Cfg", [(d, object, dataclasses.field(default=None)) for d in sorted(dests)])
    with pytest.raises(TypeError, match="valid identifiers"):
        dataclasses.make_dataclass("Cfg", [("ModelConfig.device", str)])


def test_flags_megatron_lm_already_has_are_left_alone():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seq-length", type=int, default=None)
    added = adapter.add_plugin_flags(parser)
    assert "--lr" not in added and "--seq-length" not in added
    assert "--prune-position-ratio" in added
    assert parser.parse_args(["--lr", "1e-5"]).lr == 1e-5


def _standin_features_api(monkeypatch):
    """MindSpeed's feature list from the stand-in package, plus the plugin's own feature."""
    root = STANDIN / "mindspeed"
    monkeypatch.syspath_prepend(str(STANDIN))
    for name in [m for m in sys.modules if m == "mindspeed" or m.startswith("mindspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    assert importlib.util.find_spec("mindspeed").origin == str(root / "__init__.py")
    import mindspeed.features_manager as fm

    manager, base = fm.MindSpeedFeaturesManager, fm.MindSpeedFeature
    monkeypatch.setattr(manager, "FEATURES_LIST", list(manager.FEATURES_LIST))
    adapter._add_plugin_feature(manager, base)
    adapter._add_plugin_feature(manager, base)  # idempotent
    monkeypatch.setattr(adapter, "_features_api", lambda: (manager, base))
    yield manager
    for name in [m for m in sys.modules if m == "mindspeed" or m.startswith("mindspeed.")]:
        del sys.modules[name]


@pytest.fixture
def standin_features(monkeypatch):
    yield from _standin_features_api(monkeypatch)


def test_plugin_feature_is_added_once_and_last(standin_features):
    names = [f.feature_name for f in standin_features.FEATURES_LIST]
    assert names[-1] == "megatron_prune" and names.count("megatron_prune") == 1


def test_mindspeed_preparse_types_plugin_flags(standin_features):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    standin_features.register_features_args(parser)
    known, unknown = parser.parse_known_args(["--prune-position-ratio", "0.3", "--sparse-mode", "2", "--use-flash-attn"])
    assert known.prune_position_ratio == 0.3 and known.sparse_mode == 2
    assert unknown == ["--use-flash-attn"]  # a Megatron-LM flag MindSpeed keeps as an unknown


def test_trainer_leftovers_that_mindspeed_declares(standin_features):
    ns = adapter.parse_mindspeed_flags(["--use-flash-attn", "--sparse-mode", "2", "--optimization-level", "1"])
    assert ns.use_flash_attn is True and ns.sparse_mode == 2 and ns.optimization_level == 1


@pytest.mark.parametrize("leftover", [["--no-such-flag"], ["--dpo-beta", "0.1"], ["--sparse-mode", "2", "extra"]])
def test_trainer_leftovers_that_nobody_declares(standin_features, leftover):
    # --dpo-beta is a plugin flag: if the running trainer did not take it, MindSpeed must not either.
    with pytest.raises(ValueError, match="unrecognized arguments"):
        adapter.parse_mindspeed_flags(leftover)
