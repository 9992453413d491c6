"""What the libraries we drive may print while an attnres command runs, and the progress columns we show.

`quiet_libraries()` is scoped: on entry it turns off tqdm bars (transformers' "Loading weights", the GGUF
de-quantisation, shard writing, datasets' map bars, huggingface_hub downloads), transformers' info and
warning logs, and the deprecation and future warnings raised inside these libraries; on exit it restores
all of it, so a program that uses attnres as a library keeps its own settings. Our Rich display shows the
long steps instead. Warnings raised by our own code, and any other warning, still reach the user.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from rich.progress import ProgressColumn, Task
from rich.text import Text

# Libraries whose DeprecationWarning / FutureWarning are about their own internals, not the user's input.
DRIVEN_LIBRARIES = ("transformers", "torch", "accelerate", "peft", "datasets", "huggingface_hub", "safetensors", "gguf", "tqdm")


@contextlib.contextmanager
def _no_tqdm_bars() -> Iterator[None]:
    """Every tqdm bar created meanwhile is disabled: it still iterates, it draws nothing. tqdm subclasses
    (tqdm.auto, huggingface_hub's, transformers') all pass through tqdm.std.tqdm.__init__, including
    those of modules imported later (transformers imports its GGUF loader on first use)."""
    try:
        from tqdm import std
    except ImportError:
        yield
        return
    original = std.tqdm.__init__

    def disabled(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        std.tqdm.__init__ = original


@contextlib.contextmanager
def _transformers_errors_only() -> Iterator[None]:
    """transformers' own logger shows errors only (its load reports and info lines are not for our users)."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """While the block runs: no foreign progress bars, logs or deprecation warnings from DRIVEN_LIBRARIES."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        for library in DRIVEN_LIBRARIES:
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=rf"{library}(\.|$)")
        stack.enter_context(_no_tqdm_bars())
        stack.enter_context(_transformers_errors_only())
        yield


class AverageTimeRemaining(ProgressColumn):
    """ETA from the average pace since the task started (Rich's own column uses the last 30 seconds, which
    shows nothing when one step takes longer than that). A task added with `resumed_at=N` counts
    its pace from N."""

    def __init__(self, prefix: str = ""):
        super().__init__()
        self.prefix = prefix  # e.g. "ETA ", where an elapsed time stands beside it

    def render(self, task: Task) -> Text:
        return Text(self.prefix + self._remaining(task), style="progress.remaining")

    @staticmethod
    def _remaining(task: Task) -> str:
        if task.total is None or task.elapsed is None:
            return "-:--:--"
        if task.finished:
            return "0:00:00"
        done = task.completed - task.fields.get("resumed_at", 0)
        if done <= 0 or task.elapsed <= 0:
            return "-:--:--"
        seconds = int(task.elapsed * (task.total - task.completed) / done)
        hours, rest = divmod(seconds, 3600)
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def shorten_middle(text: str, width: int) -> str:
    """TEXT in at most WIDTH characters, the middle replaced by '…' (both ends of a name say the most)."""
    if len(text) <= width or width < 5:
        return text
    head = width // 2
    tail = width - 1 - head
    return text[:head] + "…" + text[-tail:]
