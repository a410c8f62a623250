"""The benchmark tools refuse what they cannot finish before any mode runs."""

from __future__ import annotations

import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
sys.path.insert(0, os.path.abspath(TOOLS))

import bench_dpo  # noqa: E402
import bench_grpo  # noqa: E402


@pytest.mark.parametrize("tool", [bench_dpo, bench_grpo], ids=["bench_dpo", "bench_grpo"])
def test_plot_without_matplotlib_is_refused_at_once(tool, monkeypatch, capsys):
    """``--plot`` needs matplotlib, an optional extra: without it the tool stops while parsing its
    flags, naming the extra, instead of failing after every mode has run."""
    assert tool.parse_args(["--plot", "out.png"]).plot == "out.png"  # installed: accepted
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as exc:
        tool.parse_args(["--plot", "out.png"])
    assert exc.value.code == 2
    assert "--plot needs matplotlib: pip install -e '.[bench]'" in capsys.readouterr().err
    assert tool.parse_args([]).plot is None  # without --plot nothing needs it


def test_preset_help_describes_every_preset():
    text = bench_dpo._preset_help()
    for name, preset in bench_dpo.PRESETS.items():
        assert f"{name} (hidden {preset['arch']['hidden_size']}, {preset['arch']['num_layers']} layers" in text
