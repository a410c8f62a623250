"""Ctrl-C while a checkpoint is being written, through the real CLI.

The save forks writer processes (Megatron's dist checkpointing), which are in the rank's process
group and so get the SIGINT too. To land the signal inside the save every time, without a product
backdoor, a wrapper script (written to tmp_path) patches the writer function so that, in the save
of iteration ``SAVE_AT``, the first writer process sends the SIGINT itself: to the process group of
the launch, as a terminal's Ctrl-C does (one process: the CLI and its writers; torchrun: the agent,
which forwards it to every rank's process group), or to rank 0's process group alone. Under a
terminal's Ctrl-C to torchrun each first writer then waits until the forwarded signal has reached
its own process group, and rank 0's sends it only once every rank's first writer holds it back
(a file per rank in tmp_path): every rank is inside the save when it arrives, however slowly the
ranks reach it. The writer goes on writing afterwards, as an unpatched one would.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.e2e.conftest import SAMPLE, Run, launch_env, read_jsonl, run_cmd, torchrun_cmd

pytestmark = pytest.mark.e2e

SAVE_AT = 2

WRAPPER = textwrap.dedent(
    """
    import functools, os, signal, sys, time
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    save_at = f"iter_{int(sys.argv[1]):07d}.tmp" if __name__ == "__main__" else None
    launch = os.getpid() if os.environ.get("WORLD_SIZE", "1") == "1" else os.getppid()  # the agent
    real_write = FileSystemWriterAsync.write_preloaded_data

    @functools.wraps(real_write)
    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        if local_proc_idx == 0 and save_at and save_at in str(write_bucket[0]):
            if launch == os.getppid():  # one process: the CLI's own group, writers included
                os.killpg(launch, signal.SIGINT)
            elif os.environ["CTRL_C_TO"] == "rank0":  # rank 0's group alone: rank 1 never gets it
                if os.environ["RANK"] == "0":
                    os.killpg(os.getpgid(0), signal.SIGINT)
            else:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                ready = os.path.join(os.environ["CTRL_C_DIR"], "ready{}")
                open(ready.format(os.environ["RANK"]), "w").close()
                if os.environ["RANK"] == "0":  # once every rank's writer holds the signal back
                    deadline = time.monotonic() + 120
                    while not all(os.path.exists(ready.format(r)) for r in range(int(os.environ["WORLD_SIZE"]))):
                        assert time.monotonic() < deadline, "a rank's writer never reached the save"
                        time.sleep(0.05)
                    os.killpg(launch, signal.SIGINT)  # the agent's group, as a terminal's Ctrl-C
                signal.sigtimedwait({signal.SIGINT}, 120)  # forwarded to this rank's group
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return real_write(transform_list, local_proc_idx, write_bucket, *args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
    if __name__ == "__main__":  # not in the process the save spawns (it imports this script again)
        from megatron_prune.dpo.__main__ import main
        sys.exit(main(sys.argv[2:]))
    """
)

DPO = ["--model-preset", "tiny", "--data-path", SAMPLE, "--device", "cpu", "--seq-length", "128",
       "--max-prompt-length", "64", "--global-batch-size", "2", "--micro-batch-size", "2", "--lr", "1e-3"]


def _interrupt_inside_save(tmp_path, *, nproc: int, extra: list[str], to: str = "agent") -> Run:
    """Run until the Ctrl-C inside the save of SAVE_AT; check that the run printed the one line and
    stopped right after publishing that checkpoint, and that a --load run resumes from it."""
    script = tmp_path / "ctrl_c_in_save.py"
    script.write_text(WRAPPER)
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    # Far more steps than the test needs: a Ctrl-C the run lost would end it with exit code 0.
    args = [*DPO, *extra, "--train-iters", "20", "--save", str(save), "--save-interval", "1",
            "--metrics-jsonl", str(metrics)]

    def launch(target: list[str]) -> list[str]:
        return [sys.executable, *target] if nproc == 1 else torchrun_cmd(target, nproc=nproc)

    interrupted = run_cmd(launch([str(script), str(SAVE_AT), *args]), log=tmp_path / "interrupted.txt",
                          timeout=600, env=launch_env(CTRL_C_TO=to, CTRL_C_DIR=str(tmp_path)))
    out = interrupted.output
    line = f"megatron-prune: interrupted; --load {save} resumes from its newest complete checkpoint"
    assert out.count(line) == 1, out[-6000:]
    # The checkpoint being written when the signal came was finished and published, and the run
    # stopped right after it: no step past it.
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(SAVE_AT)), out[-6000:]
    assert sorted(os.listdir(save)) == [f"iter_{i:07d}" for i in range(1, SAVE_AT + 1)] + \
        ["latest_checkpointed_iteration.txt"], out[-6000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(SAVE_AT)
    resumed = run_cmd(launch(["-m", "megatron_prune.dpo", *args, "--load", str(save)]),
                      log=tmp_path / "resumed.txt", timeout=600)
    resumed.check_ok()
    assert f"[megatron-prune] loaded {save / f'iter_{SAVE_AT:07d}'} (iteration {SAVE_AT})" in resumed.output, \
        resumed.output[-6000:]
    return interrupted


def test_ctrl_c_inside_a_save_finishes_it_then_stops_with_the_one_line(tmp_path):
    """One process: exit code 130, the one line, and the checkpoint being written is complete and resumes."""
    interrupted = _interrupt_inside_save(tmp_path, nproc=1, extra=[])
    assert interrupted.returncode == 130, interrupted.output[-6000:]
    assert "Traceback" not in interrupted.output, interrupted.output[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("to", ["agent", "rank0"])
def test_ctrl_c_under_torchrun_inside_a_save_stops_every_rank_after_it(tmp_path, to):
    """torchrun, TP = 2. ``agent``: a terminal's Ctrl-C, which the agent forwards to both ranks
    inside the save; ``rank0``: only rank 0 (and its writers) gets the SIGINT, and rank 1 learns
    from it at the end of the save. Either way both ranks finish the save and stop after it
    (rank 0 prints the one line), none is left waiting in a collective, and the launch ends."""
    interrupted = _interrupt_inside_save(tmp_path, nproc=2, extra=["--tensor-model-parallel-size", "2"], to=to)
    assert interrupted.returncode != 0, interrupted.output[-6000:]  # torchrun's own code for a signal
    for sign_of_a_stuck_rank in ("Unable to shutdown process", "CollectiveTimeout", "Connection closed"):
        assert sign_of_a_stuck_rank not in interrupted.output, interrupted.output[-6000:]
