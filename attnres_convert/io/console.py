"""What the libraries we drive may print while an attnres command runs, and the progress columns we show.

`quiet_libraries()` is scoped: on entry it stops tqdm bars from drawing (transformers' "Loading weights", the
GGUF de-quantisation, shard writing, datasets' map bars, huggingface_hub downloads) and sends their progress
to our Rich display when one takes it (`library_bars_to`), and turns off transformers' info and warning logs
and the deprecation and future warnings raised inside these libraries; on exit it restores all of it, so a
program that uses attnres as a library keeps its own settings. Warnings raised by our own code, and any other warning, still reach the user.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

from rich.progress import ProgressColumn, Task
from rich.text import Text

# Libraries whose DeprecationWarning / FutureWarning are about their own internals, not the user's input.
DRIVEN_LIBRARIES = (
    "transformers",
    "torch",
    "accelerate",
    "peft",
    "datasets",
    "huggingface_hub",
    "safetensors",
    "gguf",
    "tqdm",
)


# Where the libraries' bars go while quiet_libraries() is active: the innermost display that takes them
# (`library_bars_to`), else nowhere. A list, not one value: displays nest (a push inside a convert).
AddBar = Callable[[str, "int | None"], tuple[Callable[[int], None], Callable[[], None]]]  # -> (advance(n), finish())
_BAR_DISPLAYS: list[AddBar] = []


@contextlib.contextmanager
def library_bars_to(add_bar: AddBar) -> Iterator[None]:
    """While the block runs, each tqdm bar a library opens calls ADD_BAR(description, total) for a line in our
    display, and drives it with the returned (advance(n), finish()) instead of drawing itself."""
    _BAR_DISPLAYS.append(add_bar)
    try:
        yield
    finally:
        _BAR_DISPLAYS.remove(add_bar)


@contextlib.contextmanager
def _tqdm_bars_redirected() -> Iterator[None]:
    """Every tqdm bar created meanwhile draws nothing (it still iterates); its progress goes to our display
    when one takes it. tqdm subclasses (tqdm.auto, huggingface_hub's, the bars transformers opens for the
    GGUF de-quantisation, weight loading and shard writing, datasets' map bars) all pass through
    tqdm.std.tqdm, including those of modules imported later."""
    try:
        from tqdm import std
    except ImportError:
        yield
        return
    patched = ("__init__", "__iter__", "update", "close")
    originals = {name: getattr(std.tqdm, name) for name in patched}

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        originals["__init__"](self, *args, **kwargs)
        if _BAR_DISPLAYS:
            description = str(kwargs.get("desc") or (args[1] if len(args) > 1 else "") or "working").rstrip(". :")
            self._attnres_bar = _BAR_DISPLAYS[-1](description, self.total)

    def __iter__(self):
        bar = getattr(self, "_attnres_bar", None)
        if bar is None:
            yield from originals["__iter__"](self)
            return
        try:
            for item in self.iterable:
                yield item
                bar[0](1)
        finally:
            bar[1]()

    def update(self, n=1):
        if (bar := getattr(self, "_attnres_bar", None)) is not None:
            bar[0](n)
        return originals["update"](self, n)

    def close(self):
        if (bar := getattr(self, "_attnres_bar", None)) is not None:
            bar[1]()
        return originals["close"](self)

    for name, method in zip(patched, (__init__, __iter__, update, close)):
        setattr(std.tqdm, name, method)
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(std.tqdm, name, method)


@contextlib.contextmanager
def _transformers_errors_only() -> Iterator[None]:
    """transformers' own logger shows errors only (its load reports and info lines are not for our users)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its bars stay on: they reach our display through tqdm (_tqdm_bars_redirected)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """While the block runs: no foreign progress bars, logs or deprecation warnings from DRIVEN_LIBRARIES."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        for library in DRIVEN_LIBRARIES:
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=rf"{library}(\.|$)")
        stack.enter_context(_tqdm_bars_redirected())
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
