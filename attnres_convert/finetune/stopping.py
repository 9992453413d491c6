"""How a run ends before its last step: the errors a training run raises, and the signal handling that
turns SIGINT / SIGTERM into a stop after the current step."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from ..errors import AttnResError


class TrainingError(AttnResError):
    """The run could not go on (the CLI exits 1): the message says at which step, why, what was kept."""


class NonFiniteLossError(TrainingError):
    pass


class TrainingInterrupted(AttnResError):
    """SIGINT/SIGTERM (or `stop_at_step`): a checkpoint was saved; `--resume` continues. A run that was to
    replace an earlier one is discarded instead (checkpoint None): the earlier run is kept."""

    def __init__(self, message: str, checkpoint: Path | None, signum: int = signal.SIGINT):
        super().__init__(message)
        self.checkpoint, self.signum = checkpoint, int(signum)


class GracefulStop:
    """SIGINT / SIGTERM ask the run to stop after the current step (a checkpoint is saved); a second
    signal stops at once."""

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
