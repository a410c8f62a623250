"""The benchmark tools refuse what they cannot finish before any mode runs."""

from __future__ import annotations

import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
sys.path.insert(0, os.path.abspath(TOOLS))

import bench_dpo  # noqa: E402
import bench_grpo  # noqa: E402
import bench_selective_head  # noqa: E402


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


REFUSED = [
    pytest.param(bench_dpo, ["--json", "/proc/megatron-prune/x.json"], "--json /proc/megatron-prune/x.json: cannot "
                 "write into /proc", id="dpo-json-unwritable"),
    pytest.param(bench_dpo, ["--json", "{tmp}"], "--json {tmp}: is a directory", id="dpo-json-is-a-dir"),
    pytest.param(bench_dpo, ["--plot", "{tmp}/file.txt/x.png"], "--plot {tmp}/file.txt/x.png: {tmp}/file.txt exists "
                 "and is not a directory", id="dpo-plot-under-a-file"),
    pytest.param(bench_dpo, ["--tensor-model-parallel-size", "3"],
                 "--tensor-model-parallel-size 3 does not divide the model's 4 attention heads", id="dpo-tp"),
    pytest.param(bench_dpo, ["--pipeline-model-parallel-size", "3"],
                 "--pipeline-model-parallel-size 3 does not divide the model's 4 layers", id="dpo-pp"),
    pytest.param(bench_grpo, ["--json", "{tmp}"], "--json {tmp}: is a directory", id="grpo-json-is-a-dir"),
    pytest.param(bench_grpo, ["--prompts", "8", "--num-prompts", "4"],
                 "--prompts 8 asks for 8 different prompts a step, but --num-prompts is 4", id="grpo-prompts"),
    pytest.param(bench_grpo, ["--group-size", "1"], "argument --group-size: must be >= 2, got 1", id="grpo-group-size"),
    pytest.param(bench_grpo, ["--task", "toy-binary", "--max-prompt-length", "8"],
                 "--max-prompt-length is for --task gsm8k; --task toy-binary makes its own prompts",
                 id="grpo-toy-prompt-length"),
    pytest.param(bench_grpo, ["--tensor-model-parallel-size", "3"],
                 "--tensor-model-parallel-size 3 does not divide the model's 4 attention heads", id="grpo-tp"),
    pytest.param(bench_grpo, ["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1",
                 id="grpo-sp-without-tp"),
    pytest.param(bench_grpo, ["--virtual-pipeline-model-parallel-size", "2"],
                 "--virtual-pipeline-model-parallel-size 2 needs --pipeline-model-parallel-size > 1",
                 id="grpo-vpp-without-pp"),
    pytest.param(bench_grpo, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "4"],
                 "--pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size 4 does not divide the "
                 "model's 4 layers", id="grpo-vpp"),
    pytest.param(bench_grpo, ["--seq-length", "6", "--max-new-tokens", "4"],
                 "--toy-prompt-length 3 + --max-new-tokens 4 exceed --seq-length 6", id="grpo-toy-too-long"),
    pytest.param(bench_grpo, ["--task", "gsm8k", "--max-new-tokens", "300"],
                 "--max-prompt-length 256 + --max-new-tokens 300 exceed --seq-length 512", id="grpo-gsm8k-too-long"),
]


@pytest.mark.parametrize("tool, argv, message", REFUSED)
def test_what_no_worker_could_run_is_refused_while_parsing(tool, argv, message, tmp_path, capsys):
    """Output paths, the layout against the model and the batch against the prompts: one line
    while parsing flags (exit 2), before any mode trains or any worker prints a traceback."""
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(SystemExit) as exc:
        tool.parse_args([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


BAD_VALUES = [
    (bench_dpo, "--micro-batch-size", "0", "must be >= 1, got 0"),
    (bench_dpo, "--tensor-model-parallel-size", "0", "must be >= 1, got 0"),
    (bench_dpo, "--pairs", "0", "must be >= 1, got 0"),
    (bench_dpo, "--timeout", "0", "must be > 0, got 0"),
    (bench_dpo, "--warmup", "-1", "must be >= 0, got -1"),
    (bench_grpo, "--lr", "-1", "must be > 0, got -1"),
    (bench_grpo, "--kl-beta", "-1", "must be >= 0.0, got -1"),
    (bench_grpo, "--max-new-tokens", "0", "must be >= 1, got 0"),
    (bench_grpo, "--eval-temperature", "-1", "must be >= 0.0, got -1"),
    (bench_grpo, "--micro-batch-size", "0", "must be >= 1, got 0"),
    (bench_grpo, "--threads", "0", "must be >= 1, got 0"),
    (bench_grpo, "--grad-variance", "-1", "must be >= 0, got -1"),
    (bench_grpo, "--max-step-factor", "0.5", "must be >= 1.0, got 0.5"),
    (bench_grpo, "--tensor-model-parallel-size", "0", "must be >= 1, got 0"),
    (bench_grpo, "--steps", "two", "expected an integer, got 'two'"),
    (bench_selective_head, "--vocab-size", "0", "must be >= 1, got 0"),
    (bench_selective_head, "--hidden-size", "0", "must be >= 1, got 0"),
    (bench_selective_head, "--seq-lens", "-4", "must be >= 1, got -4"),
    (bench_selective_head, "--chunk-size", "0", "must be >= 1, got 0"),
    (bench_selective_head, "--iters", "0", "must be >= 1, got 0"),
    (bench_selective_head, "--scored-fraction", "0", "--scored-fraction must be in (0, 1], got 0.0"),
]


@pytest.mark.parametrize("tool, flag, value, message", BAD_VALUES,
                         ids=[f"{t.__name__}{f}={v}" for t, f, v, _ in BAD_VALUES])
def test_bad_counts_and_amounts_are_refused_while_parsing(tool, flag, value, message, capsys):
    """A zero or negative count, rate or time: ``prog: error:`` naming the flag, exit 2. They were
    ZeroDivisionErrors, worker tracebacks, or runs that printed 0 and nan figures."""
    with pytest.raises(SystemExit) as exc:
        tool.parse_args([flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error:" in err and flag in err and message in err, err


def test_cuda_without_a_gpu_is_refused_before_any_worker(monkeypatch, capsys):
    """Parsed (the GPU script's commands parse anywhere), then refused when the tool runs."""
    import subprocess

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a worker started"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a worker started"))
    for tool, name in ((bench_dpo, "bench_dpo.py"), (bench_grpo, "bench_grpo.py")):
        assert tool.parse_args(["--device", "cuda"]).device == "cuda"
        with pytest.raises(SystemExit) as exc:
            tool.main(["--device", "cuda"])
        assert exc.value.code == 2
        assert (f"{name}: error: --device cuda was requested but torch.cuda.is_available() is False; "
                "use --device cpu") in capsys.readouterr().err


SMALL_RUN = ["--preset", "cpu-small", "--warmup", "0", "--steps", "1", "--memory-steps", "1", "--pairs", "2",
             "--micro-batch-size", "1", "--max-seq-length", "128"]


def _failing(mode: str, round_: int, launched: list):
    """bench_dpo's launch, with ``mode``'s worker failing in round ``round_`` (as out of memory would)."""
    import subprocess

    real = bench_dpo.launch

    def launch(args, name, out, **kwargs):
        launched.append(os.path.basename(out))
        if os.path.basename(out) == f"{mode}-{round_}.json":
            raise subprocess.CalledProcessError(1, ["worker", name])
        return real(args, name, out, **kwargs)
    return launch


def test_a_concat_that_fails_first_stops_the_run_at_once(tmp_path, monkeypatch):
    """Without a concat round no mode has a ratio: the other modes do not run (a GPU budget is not
    spent on them), and the JSON says what failed."""
    launched: list = []
    monkeypatch.setattr(bench_dpo, "launch", _failing("concat", 0, launched))
    with pytest.raises(SystemExit, match="modes that failed .*: concat"):
        bench_dpo.main([*SMALL_RUN, "--modes", "concat", "branch", "--json", str(tmp_path / "r.json")])
    assert launched == ["concat-0.json"]
    import json

    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["modes"] == {} and saved["records"] == {} and list(saved["failed"]) == ["concat"]
