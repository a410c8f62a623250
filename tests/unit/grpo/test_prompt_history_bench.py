"""tools/bench_prompt_history.py: the real prompt level of DPPO on simulated pass/fail groups."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

import bench_prompt_history  # noqa: E402

SMALL = ["--pool", "128", "--batch", "32", "--steps", "80", "--warmup", "10", "--seeds", "2"]


def test_pass_rate_history_adds_about_the_oracles_variance_where_std_doubles_it(tmp_path, capsys):
    """On a pool of mostly always- or never-solved prompts at floor 0.1, the pass-rate history keeps
    prompts with about the oracle's added variance; the std history, which floors a prompt after one
    all-equal group, adds more than the uniform rule does (1/p of the informative groups it
    mispredicted). Every kind sees the same batches and rewards."""
    out = bench_prompt_history.main([*SMALL, "--prompt-floor", "0.1", "--json", str(tmp_path / "h.json")])
    added = {kind: figures["added_variance"]["mean"] for kind, figures in out["scores"].items()}
    assert added["uniform"] == pytest.approx(1.0, abs=0.02)  # 1/p - 1 at p = 1 - r_q = 0.5
    assert added["oracle"] < 0.9
    assert added["pass-rate"] < min(1.1 * added["oracle"], 0.95)
    assert added["std"] > 1.3
    zero_all = {figures["zero_var_all"]["mean"] for figures in out["scores"].values()}
    assert len(zero_all) == 1 and 0.2 < zero_all.pop() < 0.6
    assert out["scores"]["oracle"]["zero_var_kept"]["mean"] < out["scores"]["uniform"]["zero_var_kept"]["mean"] - 0.1
    assert json.loads((tmp_path / "h.json").read_text())["scores"] == out["scores"]
    assert "pass-rate" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--batch", "300"], "--batch 300 is larger than --pool 256"),
    (["--warmup", "5", "--steps", "5"], "--warmup 5 leaves no step of --steps 5"),
    (["--prompt-rate", "0.8"], "--prompt-rate 0.8 cannot be reached with --prompt-floor 0.3"),
    (["--group-size", "1"], "--group-size must be >= 2, got 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench_prompt_history.parse_args(argv)
    assert message in (str(info.value) + capsys.readouterr().err)
