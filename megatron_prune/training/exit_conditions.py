"""When a run stops before ``--train-iters``: ``--exit-signal-handler``, ``--exit-duration-in-mins``
and ``--exit-interval`` (Megatron's flags, same meaning).

The loop asks :meth:`ExitConditions.reason` at the end of every step. A signal or a clock reaches the
ranks at different moments, so both are agreed in one all-reduce (a flag is true when it is true on any
rank) and every rank stops after the same step; the step interval needs no agreement. The signal
handler only records the signal: the step in progress finishes, and the loop saves before it stops.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

from megatron_prune.config import CheckpointConfig

__all__ = ["ExitConditions", "LAUNCHED_AT"]

LAUNCHED_AT = time.monotonic()
"""When this process imported the trainers (the CLI imports this module before torch and Megatron,
so this module imports neither at load): the clock that ``--exit-duration-in-mins`` reads, so
imports, model building and ``--load`` count against it, as they count against a job's time limit."""


class ExitConditions:
    """The stop conditions of one run; :meth:`watching` installs the signal handler for the loop."""

    def __init__(self, ckpt: CheckpointConfig) -> None:
        self.signal = signal.Signals[ckpt.exit_signal] if ckpt.exit_signal_handler else None
        self.deadline = (LAUNCHED_AT + 60.0 * ckpt.exit_duration_in_mins
                         if ckpt.exit_duration_in_mins is not None else None)
        self.minutes = ckpt.exit_duration_in_mins
        self.interval = ckpt.exit_interval
        self.received = False

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Record ``--exit-signal`` instead of dying of it, for the block; the previous handler after."""
        if self.signal is None:
            yield
            return

        def record(signum, frame):
            self.received = True

        previous = signal.signal(self.signal, record)
        try:
            yield
        finally:
            signal.signal(self.signal, previous)

    def reason(self, done: int) -> str | None:
        """Why the run stops after ``done`` steps, or None to go on. Collective when a signal or a
        duration is watched (every rank calls it after every step)."""
        received = timed_out = False
        if self.signal is not None or self.deadline is not None:
            from megatron_prune.training.parallel import any_rank

            timed_out = self.deadline is not None and time.monotonic() >= self.deadline
            received, timed_out = any_rank(self.received, timed_out)
        if received:
            return f"{self.signal.name} received (--exit-signal-handler)"
        if timed_out:
            return f"{self.minutes:g} minutes since launch (--exit-duration-in-mins)"
        if self.interval is not None and done % self.interval == 0:
            return f"step {done} is a multiple of --exit-interval {self.interval}"
        return None
