"""When a run stops before ``--train-iters``: ``--exit-signal-handler``, ``--exit-duration-in-mins``
and ``--exit-interval`` (Megatron's flags, same meaning).

The loop asks :meth:`ExitConditions.reason` at the end of every step. A signal or a clock reaches the
ranks at different moments, so both are agreed in one all-reduce (a flag is true when it is true on any
rank) and every rank stops after the same step; the step interval needs no agreement. The signal
handler only records the signal: the step in progress finishes, and the loop saves before it stops.
The CLI records it from the start of the run (model building, data, the reference table, ``--load``),
and a signal recorded before the first step stops the run there (:meth:`ExitConditions.received_before_start`).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

from megatron_prune.config import CheckpointConfig

__all__ = ["ExitConditions", "LAUNCHED_AT", "recording", "watched_signal"]

LAUNCHED_AT = time.monotonic()
"""When this process imported the trainers (the CLI imports this module before torch and Megatron,
so this module imports neither at load): the clock that ``--exit-duration-in-mins`` reads, so
imports, model building and ``--load`` count against it, as they count against a job's time limit."""


_received: set[signal.Signals] = set()  # what the handlers of the open recording blocks recorded
_open_blocks = 0


def watched_signal(ckpt: CheckpointConfig) -> signal.Signals | None:
    """The signal ``--exit-signal-handler`` watches (``--exit-signal``), or None without the flag."""
    return signal.Signals[ckpt.exit_signal] if ckpt.exit_signal_handler else None


@contextlib.contextmanager
def recording(sig: signal.Signals | None) -> Iterator[None]:
    """Record ``sig`` instead of dying of it, for the block; the previous handler after. Blocks
    nest (the CLI's around the whole run, the loop's around its steps): what an outer block
    recorded counts inside the inner one, and only the outermost block starts from nothing."""
    global _open_blocks
    if sig is None:
        yield
        return
    if _open_blocks == 0:
        _received.discard(sig)
    previous = signal.signal(sig, lambda signum, frame: _received.add(sig))
    _open_blocks += 1
    try:
        yield
    finally:
        _open_blocks -= 1
        signal.signal(sig, previous)


class ExitConditions:
    """The stop conditions of one run; :meth:`watching` installs the signal handler for the loop."""

    def __init__(self, ckpt: CheckpointConfig) -> None:
        self.signal = watched_signal(ckpt)
        self.deadline = (LAUNCHED_AT + 60.0 * ckpt.exit_duration_in_mins
                         if ckpt.exit_duration_in_mins is not None else None)
        self.minutes = ckpt.exit_duration_in_mins
        self.interval = ckpt.exit_interval

    @property
    def received(self) -> bool:
        """Whether this rank got the watched signal (in this block or an enclosing one)."""
        return self.signal is not None and self.signal in _received

    def watching(self) -> contextlib.AbstractContextManager[None]:
        """Record ``--exit-signal`` instead of dying of it, for the block; the previous handler after."""
        return recording(self.signal)

    def received_before_start(self) -> bool:
        """Whether any rank got the watched signal before the first step (while the run was
        starting up). Collective when a signal is watched."""
        if self.signal is None:
            return False
        from megatron_prune.training.parallel import any_rank

        (received,) = any_rank(self.received)
        return received

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
