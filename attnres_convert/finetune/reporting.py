"""What a run shows on the console: stage lines, the Rich progress bar, evaluation lines (main process only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Reporter:
    """Console output of the main process: stage lines, the Rich progress bar, evaluation lines. Every
    method does nothing in the other processes (or without a console)."""

    def __init__(self, console, enabled: bool, verbose: bool = False):
        self.console = console if enabled else None
        self.verbose = verbose  # the whole resolved recipe, not only the fields that matter
        self.progress = None
        self.task = None

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)

    @contextlib.contextmanager
    def bar(self, total: int, start: int) -> Iterator[None]:
        if self.console is None:
            yield
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from ..io.console import AverageTimeRemaining

        # Fits 80 columns; the ETA is the average pace of the run (a CPU step can take longer than Rich's window).
        # tok/s: training tokens over the seconds spent in training steps so far (evaluations and checkpoints not
        # counted), the figure the command's summary line ends with.
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=12),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[speed]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            AverageTimeRemaining(),
            console=self.console,
        )
        with self.progress:
            self.task = self.progress.add_task(
                "train", total=total, completed=start, resumed_at=start, loss="-", lr="-", speed="-"
            )
            yield
        self.progress = None

    def step(self, step: int, loss: float, lr: float, speed: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", lr=f"{lr:.2e}", speed=f"{speed:,.0f}")

    def print(self, text: str) -> None:
        """A line above the progress bar while it is shown."""
        if self.progress is not None:
            self.progress.console.print(text, highlight=False)
        else:
            self.say(text)
