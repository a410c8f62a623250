"""--exit-signal-handler, --exit-duration-in-mins and --exit-interval: when the loop stops, and the
ranks' agreement on it (the loop itself, through the CLI: tests/e2e/test_exit_conditions.py)."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_prune.config import CheckpointConfig
from megatron_prune.training import exit_conditions
from megatron_prune.training.exit_conditions import ExitConditions
from tests.dist import run_distributed


def test_exit_interval_stops_at_its_multiples_only():
    exits = ExitConditions(CheckpointConfig(exit_interval=3))
    assert [d for d in range(1, 10) if exits.reason(d)] == [3, 6, 9]
    assert exits.reason(3) == "step 3 is a multiple of --exit-interval 3"
    assert ExitConditions(CheckpointConfig()).reason(4) is None


def test_exit_duration_counts_from_launch(monkeypatch):
    exits = ExitConditions(CheckpointConfig(exit_duration_in_mins=0.5))
    now = exit_conditions.LAUNCHED_AT + 29.9
    monkeypatch.setattr(exit_conditions.time, "monotonic", lambda: now)
    assert exits.reason(1) is None
    now = exit_conditions.LAUNCHED_AT + 30.0
    assert exits.reason(2) == "0.5 minutes since launch (--exit-duration-in-mins)"


def test_the_signal_is_recorded_inside_the_block_and_the_old_handler_comes_back(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    exits = ExitConditions(CheckpointConfig(save=str(tmp_path), exit_signal_handler=True, exit_signal="SIGUSR1"))
    with exits.watching():
        assert exits.reason(1) is None
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to this (main) thread before kill returns
        assert exits.reason(2) == "SIGUSR1 received (--exit-signal-handler)"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_only_the_chosen_signal_is_watched(tmp_path):
    """The default --exit-signal is SIGTERM; other signals keep their handlers."""
    term, usr1 = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    exits = ExitConditions(CheckpointConfig(save=str(tmp_path), exit_signal_handler=True))
    with exits.watching():
        assert signal.getsignal(signal.SIGTERM) is not term
        assert signal.getsignal(signal.SIGUSR1) is usr1
    assert signal.getsignal(signal.SIGTERM) is term


@pytest.mark.parametrize("kwargs, message", [
    ({"exit_signal_handler": True}, "--exit-signal-handler needs --save"),
    ({"exit_interval": 0}, "--exit-interval must be >= 1"),
    ({"exit_duration_in_mins": 0.0}, "--exit-duration-in-mins must be a number > 0"),
    ({"exit_duration_in_mins": float("nan")}, "--exit-duration-in-mins must be a number > 0"),
])
def test_bad_exit_flags_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**kwargs)


def _one_rank_signalled(save: str) -> list:
    import torch.distributed as dist

    exits = ExitConditions(CheckpointConfig(save=save, exit_signal_handler=True, exit_duration_in_mins=60.0))
    with exits.watching():
        reasons = [exits.received_before_start(), exits.reason(1)]
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        reasons.append(exits.reason(2))
    return reasons


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Rank 1 alone got the signal; both ranks see it at the end of the same step (one all-reduce)."""
    reasons = run_distributed(_one_rank_signalled, 2, save=str(tmp_path))
    assert reasons == [[False, None, "SIGTERM received (--exit-signal-handler)"]] * 2


def _signalled_while_starting(save: str) -> list[bool]:
    """The CLI's block around the whole run records the signal on rank 1 before the loop's own
    block opens; both ranks learn it before the first step."""
    import torch.distributed as dist

    ckpt = CheckpointConfig(save=save, exit_signal_handler=True)
    with exit_conditions.recording(exit_conditions.watched_signal(ckpt)):
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # while the model, data or checkpoint load
        exits = ExitConditions(ckpt)
        with exits.watching():
            return [exits.received_before_start(), exits.received]


def test_a_signal_while_starting_up_is_agreed_before_the_first_step(tmp_path):
    assert run_distributed(_signalled_while_starting, 2, save=str(tmp_path)) == [[True, False], [True, True]]


def test_a_new_run_starts_without_the_last_runs_signal(tmp_path):
    """Only the outermost block starts from nothing: a signal recorded by an earlier run in the same
    process (in-process launches) does not stop the next one."""
    ckpt = CheckpointConfig(save=str(tmp_path), exit_signal_handler=True, exit_signal="SIGUSR1")
    with exit_conditions.recording(exit_conditions.watched_signal(ckpt)):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ExitConditions(ckpt).received
    with exit_conditions.recording(exit_conditions.watched_signal(ckpt)):
        assert not ExitConditions(ckpt).received_before_start()


def test_a_run_that_fails_inside_the_block_leaves_the_old_handler_and_no_signal_behind(tmp_path):
    """A usage error (SystemExit) inside the CLI's block after the signal came: the previous handler is
    back, and the next in-process run starts without that signal."""
    ckpt = CheckpointConfig(save=str(tmp_path), exit_signal_handler=True, exit_signal="SIGUSR1")
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit):
        with exit_conditions.recording(exit_conditions.watched_signal(ckpt)):
            os.kill(os.getpid(), signal.SIGUSR1)
            raise SystemExit(2)
    assert signal.getsignal(signal.SIGUSR1) is before
    with exit_conditions.recording(exit_conditions.watched_signal(ckpt)):
        assert not ExitConditions(ckpt).received_before_start()
    assert signal.getsignal(signal.SIGUSR1) is before
