"""Helpers to launch the real CLI through torchrun as a subprocess, always with a timeout.

Every launch runs in its own session; a timeout (or a deliberate SIGKILL) kills the agent and
all its ranks together (each rank is in a session of its own, so the whole process tree is
collected first) and cannot leave stray processes behind for the next test.
Each launch costs ~15-40 s on a small CPU machine (importing Megatron dominates): tests are
designed around few launches.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE = str(REPO / "megatron_prune" / "data" / "samples" / "hh_rlhf_sample.jsonl")

# A tiny DPO run with every pruning on (the defaults are exact DPO: pruning is asked for explicitly).
TINY_DPO = [
    "--model-preset", "tiny", "--data-path", SAMPLE,
    "--seq-length", "128", "--max-prompt-length", "64",
    "--global-batch-size", "8", "--micro-batch-size", "2",
    "--lr", "1e-3", "--prune-position-ratio", "0.6", "--prune-seq-min-ratio", "0.5", "--prune-branch",
]


def free_port() -> int:
    """A port free now, for launches that must agree on one in advance (two agents as two nodes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # The repository first; a PYTHONPATH already set (packages installed with pip --target) is kept after it.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=path, PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def torchrun_cmd(target: list[str], *, nproc: int = 2, rdzv: list[str] | None = None) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) of ``target`` (``-m pkg ...`` or a script)."""
    # Port 0: the agent binds a free port itself and its workers join its store, so no port is
    # probed here and bound later (a concurrent job could take it in between).
    rdzv = rdzv if rdzv is not None else ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                                          "--nnodes", "1"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *rdzv, *target]


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float

    def check_ok(self) -> "Run":
        assert self.returncode == 0, f"exit code {self.returncode}; output tail:\n{self.output[-6000:]}"
        return self


LAUNCH_TOKEN = "MEGATRON_PRUNE_TEST_LAUNCH"
"""Environment variable carrying a per-launch token: every process of a launch inherits it, so a
rank that torchrun was still spawning when the tree was collected is found and killed too."""


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, LAUNCH_TOKEN: token}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    proc.launch_token = token  # type: ignore[attr-defined]
    return proc


def _launched_by(token: str) -> list:
    import psutil

    found = []
    for candidate in psutil.process_iter():
        try:
            if candidate.environ().get(LAUNCH_TOKEN) == token:
                found.append(candidate)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launch and every descendant: torchrun starts each rank in a new session, so
    killing the agent's process group alone would leave the ranks running."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    token = getattr(proc, "launch_token", None)
    for _ in range(3):  # a rank being spawned during the first sweep shows up in the next one
        for child in family:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, timeout=30)
        family = _launched_by(token) if token else []
        if not family:
            break
    proc.wait()


def run_cmd(cmd: list[str], *, log: Path, timeout: float = 300, env: dict[str, str] | None = None) -> Run:
    """Run ``cmd`` to completion in its own process group; kill the group and fail on timeout."""
    t0 = time.monotonic()
    proc = _start(cmd, env or launch_env(), log)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{log.read_text()[-6000:]}")
    return Run(proc.returncode, log.read_text(), time.monotonic() - t0)


def run_dpo(args: list[str], *, log: Path, nproc: int = 2, timeout: float = 300) -> Run:
    """``torchrun --nproc-per-node N -m megatron_prune.dpo ARGS``."""
    return run_cmd(torchrun_cmd(["-m", "megatron_prune.dpo", *args], nproc=nproc), log=log, timeout=timeout)


def run_until(cmd: list[str], *, log: Path, metrics: Path, lines: int, timeout: float = 300) -> Run:
    """Start ``cmd`` and SIGKILL the launch and all its ranks once ``metrics`` has ``lines`` lines."""
    t0 = time.monotonic()
    proc = _start(cmd, launch_env(), log)
    try:
        while time.monotonic() - t0 < timeout:
            if metrics.exists() and len(read_jsonl(metrics)) >= lines:
                break
            if proc.poll() is not None:
                pytest.fail(f"run ended (exit {proc.returncode}) before {lines} steps:\n{log.read_text()[-6000:]}")
            time.sleep(0.05)
        else:
            pytest.fail(f"no {lines} steps within {timeout}s:\n{log.read_text()[-6000:]}")
    finally:
        _kill_group(proc)
    return Run(proc.returncode, log.read_text(), time.monotonic() - t0)


def run_dpo_until(args: list[str], *, log: Path, metrics: Path, lines: int, nproc: int = 2,
                  timeout: float = 300) -> Run:
    """Start a DPO run and SIGKILL it once ``metrics`` has ``lines`` lines."""
    return run_until(torchrun_cmd(["-m", "megatron_prune.dpo", *args], nproc=nproc), log=log, metrics=metrics,
                     lines=lines, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    """Complete lines only (a line being written is ignored)."""
    text = path.read_text()
    return [json.loads(line) for line in text.split("\n")[: text.count("\n")] if line.strip()]


def undocumented_keys(records: list[dict], doc: str) -> list[str]:
    """Metrics keys of ``records`` that ``docs/<doc>`` does not name as `key` (users read the keys there)."""
    text = (REPO / "docs" / doc).read_text() + (REPO / "docs" / "dpo.md").read_text()  # dpo.md: every trainer's keys
    return sorted({k for r in records for k in r} - {k for k in {k for r in records for k in r} if f"`{k}`" in text})


def last_per_step(records: list[dict]) -> dict[int, dict]:
    """The last record of each step (a resumed run appends the steps it replays)."""
    return {r["step"]: r for r in records}


def check_resumed_steps(*, killed: list[dict], records: list[dict], reference: list[dict], published: int,
                        keys) -> None:
    """The resumed run (``records`` after the ``killed`` run's) logged every step from the
    ``published`` checkpoint on, and each step's ``keys`` equal the uninterrupted ``reference`` bit for bit."""
    assert [r["step"] for r in records[len(killed):]] == list(range(published, len(reference)))
    got = last_per_step(records)
    for ref in reference:
        for key in keys:
            assert got[ref["step"]][key] == ref[key], f"step {ref['step']} {key}: {got[ref['step']][key]!r} != {ref[key]!r}"


@pytest.fixture(scope="session")
def trained_reference(tmp_path_factory) -> Path:
    """A tiny DPO checkpoint two steps (at --lr 1e-2) away from the fresh policy of the same seed: a
    ``--ref-load`` whose margins against that policy are not 0. Read-only for the tests sharing it."""
    d = tmp_path_factory.mktemp("trained_reference")
    run_cmd([sys.executable, "-m", "megatron_prune.dpo", "--model-preset", "tiny", "--data-path", SAMPLE,
             "--device", "cpu", "--seq-length", "128", "--max-prompt-length", "64", "--global-batch-size", "4",
             "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "2", "--save", str(d / "ckpt")],
            log=d / "log.txt").check_ok()
    return d / "ckpt"


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    """In-process tests must not see a torchrun environment of the outer shell."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
