"""Stopping before --train-iters through the real CLI: --exit-duration-in-mins, --exit-interval and
--exit-signal-handler save a checkpoint at the step they stop after, exit 0 (the ranks' own code),
and the same command launched again resumes from it to the uninterrupted run's losses, bit for bit."""

from __future__ import annotations

import signal
import sys
import textwrap
import time

import psutil
import pytest

from tests.e2e.conftest import (
    TINY_DPO, _kill_group, _start, launch_env, last_per_step, read_jsonl, run_cmd, torchrun_cmd,
)

pytestmark = pytest.mark.e2e

STEPS = 4
DPO = ["-m", "megatron_prune.dpo", *TINY_DPO]


def _stops(output: str, done: int, why: str, save) -> None:
    line = f"[megatron-prune] stopping after step {done}/{STEPS}: {why}; --load {save} resumes"
    assert output.count(line) == 1, output[-4000:]


def test_duration_and_interval_stop_after_a_save_and_the_same_command_resumes_exactly(tmp_path):
    """A launch script passes --save X --load X every time. The first launch runs out of its
    (tiny) duration after step 1, the second stops at --exit-interval 2, the third finishes: the
    four steps equal an uninterrupted run's."""
    ref = tmp_path / "ref.jsonl"
    run_cmd([sys.executable, *DPO, "--train-iters", str(STEPS), "--metrics-jsonl", str(ref)],
            log=tmp_path / "ref.txt").check_ok()
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    base = [sys.executable, *DPO, "--train-iters", str(STEPS), "--save", str(ckpt), "--load", str(ckpt),
            "--metrics-jsonl", str(metrics)]

    first = run_cmd([*base, "--exit-duration-in-mins", "1e-4"], log=tmp_path / "first.txt").check_ok()
    _stops(first.output, 1, "0.0001 minutes since launch (--exit-duration-in-mins)", ckpt)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    second = run_cmd([*base, "--exit-interval", "2"], log=tmp_path / "second.txt").check_ok()
    _stops(second.output, 2, "step 2 is a multiple of --exit-interval 2", ckpt)
    assert f"loaded {ckpt / 'iter_0000001'} (iteration 1)" in second.output, second.output[-4000:]
    third = run_cmd([*base, "--exit-interval", "2"], log=tmp_path / "third.txt").check_ok()
    assert "stopping after" not in third.output, third.output[-4000:]  # step 4 = --train-iters ends the run
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000004"]

    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(STEPS))
    got = last_per_step(records)
    for r in read_jsonl(ref):
        for key in ("loss", "grad_norm", "margin", "scored_positions"):
            assert got[r["step"]][key] == r[key], (r["step"], key)


def _signal_mid_run(tmp_path, *, target: str) -> tuple[int, str, list[dict], int]:
    """torchrun, TP = 2, --exit-signal-handler: SIGTERM after the first logged step to the agent
    (as scancel or a node's shutdown sends it; the agent forwards it to every rank) or to rank 1
    alone. Return the launch's exit code, output, metrics and the published iteration."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    cmd = torchrun_cmd([*DPO, "--tensor-model-parallel-size", "2", "--train-iters", "40",
                        "--save", str(ckpt), "--exit-signal-handler", "--metrics-jsonl", str(metrics)], nproc=2)
    log = tmp_path / "log.txt"
    proc = _start(cmd, launch_env(), log)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and read_jsonl(metrics)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        if target == "agent":
            proc.send_signal(signal.SIGTERM)
        else:
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
            assert len(ranks) == 1, ranks
            ranks[0].send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        _kill_group(proc)
    output = log.read_text()
    published = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    return proc.returncode, output, read_jsonl(metrics), published


def test_sigterm_to_torchrun_saves_after_the_step_in_progress_then_every_rank_stops(tmp_path):
    returncode, output, records, published = _signal_mid_run(tmp_path, target="agent")
    done = len(records)
    assert 1 <= done < 40 and published == done, output[-4000:]
    assert [r["step"] for r in records] == list(range(done))
    line = (f"[megatron-prune] stopping after step {done}/40: SIGTERM received (--exit-signal-handler); "
            f"--load {tmp_path / 'ckpt'} resumes")
    assert output.count(line) == 1, output[-4000:]
    assert returncode != 0  # torchrun's own code for a signal it got; the ranks exited 0 before it
    for sign_of_a_lost_rank in ("CollectiveTimeout", "Connection closed", "Unable to shutdown process"):
        assert sign_of_a_lost_rank not in output, output[-4000:]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_the_same_step(tmp_path):
    """Only rank 1 gets the signal: both ranks stop after the same step, the save completes and
    the launch ends with exit code 0."""
    returncode, output, records, published = _signal_mid_run(tmp_path, target="rank1")
    done = len(records)
    assert returncode == 0 and 1 <= done < 40 and published == done, output[-4000:]
    assert f"stopping after step {done}/40: SIGTERM received (--exit-signal-handler)" in output


SIGNAL_FROM_RANK_1 = textwrap.dedent(
    """
    import importlib, os, signal, sys

    module_name, name = os.environ["SIGNAL_IN"].rsplit(".", 1)  # e.g. megatron_prune.training.loop.resume
    module = importlib.import_module(module_name)
    real = getattr(module, name)

    def signalled(*args, **kwargs):  # rank 1 gets SIGTERM as it enters the function
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    setattr(module, name, signalled)
    if __name__ == "__main__":  # the checkpoint writer's worker processes import this file again
        from megatron_prune.dpo.__main__ import main
        sys.exit(main(sys.argv[1:]))
    """
)


def _signalled_in(tmp_path, where: str, args: list[str], log: str):
    script = tmp_path / "signal_from_rank_1.py"
    script.write_text(SIGNAL_FROM_RANK_1)
    return run_cmd(torchrun_cmd([str(script), *args]), log=tmp_path / log, env=launch_env(SIGNAL_IN=where))


def test_sigterm_to_one_rank_while_starting_up_stops_every_rank_before_the_first_step(tmp_path):
    """A preemption that lands before the first step (on rank 1, as the flags are checked or as the
    checkpoint loads) stops both ranks there with exit code 0 and one line saying what a relaunch
    does, instead of killing the rank; no step is trained and no checkpoint saved."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*TINY_DPO, "--tensor-model-parallel-size", "2", "--train-iters", str(STEPS), "--save", str(ckpt),
            "--load", str(ckpt), "--exit-signal-handler", "--metrics-jsonl", str(metrics)]
    fresh = _signalled_in(tmp_path, "megatron_prune.training.session.validate", args, "fresh.txt")
    fresh.check_ok()
    assert fresh.output.count(
        f"[megatron-prune] stopping before step 1/{STEPS}: SIGTERM received (--exit-signal-handler) while starting "
        "up; no step trained, no checkpoint saved; launched again, it starts from the beginning") == 1, fresh.output[-4000:]
    assert not (metrics.exists() and read_jsonl(metrics)) and not list(ckpt.glob("iter_*"))

    run_cmd([sys.executable, *DPO, "--train-iters", "1", "--save", str(ckpt)], log=tmp_path / "one.txt").check_ok()
    resumed = _signalled_in(tmp_path, "megatron_prune.training.loop.resume", args, "resumed.txt")
    resumed.check_ok()
    assert (f"stopping before step 2/{STEPS}: SIGTERM received (--exit-signal-handler) while starting up; no step "
            f"trained, no checkpoint saved; --load {ckpt} resumes from iteration 1") in resumed.output, resumed.output[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_sigterm_to_one_rank_after_the_last_step_lets_the_run_end(tmp_path):
    """A signal that lands after the last step (here: as rank 1 leaves the process group) is
    recorded like any other: the run ends with exit code 0 and its final checkpoint."""
    ckpt = tmp_path / "ckpt"
    args = [*TINY_DPO, "--tensor-model-parallel-size", "2", "--train-iters", "1", "--save", str(ckpt),
            "--exit-signal-handler"]
    done = _signalled_in(tmp_path, "megatron_prune.training.parallel.shutdown_distributed", args, "log.txt")
    done.check_ok()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
