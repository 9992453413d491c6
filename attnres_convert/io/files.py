"""The text files a command or recipe names (paths, globs, `shakespeare:NAME`), found and checked with the
standard library only, so that a wrong path is answered before torch is imported."""

from __future__ import annotations

import difflib
import fnmatch
import glob
import os
from pathlib import Path

from ..errors import AttnResError, DataError
from ..optional import available, missing_message

SHAKESPEARE_PREFIX = "shakespeare:"
TEXT_SUFFIXES = {".txt", ".md", ".text"}
JSON_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}


def expand_files(patterns: list[str], field: str) -> tuple[list[Path], list[str]]:
    """Paths for FILES (globs, `shakespeare:GLOB`), in a stable order, and the problems found (each line
    starts with `field[index]`, the pattern it is about)."""
    found: list[Path] = []
    problems: list[str] = []
    for index, pattern in enumerate(patterns):
        where = f"{field}[{index}]"
        if pattern.startswith(SHAKESPEARE_PREFIX):
            from .samples import shakespeare_plays

            try:
                plays = shakespeare_plays()
            except AttnResError as error:
                problems.append(f"{where}: {error}")
                continue
            wanted = pattern[len(SHAKESPEARE_PREFIX) :] or "*"
            matches = [p for p in plays if fnmatch.fnmatch(p.name[: -len("_gut.txt")], wanted)]
            if not matches:
                problems.append(f"{where}: {_no_play(wanted, plays)}")
        else:
            expanded = os.path.expanduser(pattern)
            matches = (
                sorted(Path(p) for p in glob.glob(expanded, recursive=True))
                if glob.has_magic(expanded)
                else [Path(expanded)]
            )
            matches = [m for m in matches if m.is_file()] if glob.has_magic(expanded) else matches
            if not matches:
                problems.append(f"{where}: no file matches {pattern!r}")
                continue
            for match in matches:
                if match.is_dir():
                    problems.append(f"{where}: {match} is a folder; give files or a glob like '{match}/*.txt'")
                elif not match.is_file():
                    problems.append(f"{where}: file {match} does not exist{_as_a_play(pattern)}")
                elif match.stat().st_size == 0:
                    problems.append(f"{where}: file {match} is empty")
                elif match.suffix.lower() not in TEXT_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES:
                    problems.append(
                        f"{where}: {match} has an unknown type; use .txt/.md (plain text), .jsonl/.json or .parquet"
                    )
                elif match.suffix.lower() in PARQUET_SUFFIXES and not available("pyarrow"):
                    problems.append(f"{where}: {missing_message('pyarrow', f'reading {match} (a Parquet file)')}")
            matches = [m for m in matches if m.is_file() and m.stat().st_size > 0]
        found.extend(m for m in matches if m not in found)
    return found, problems


def checked_files(patterns: list[str], option: str) -> list[Path]:
    """The files PATTERNS name; a DataError listing every problem, each starting with OPTION[index]."""
    files, problems = expand_files(list(patterns), option)
    if problems:
        raise DataError("\n".join(problems))
    return files


def _as_a_play(pattern: str) -> str:
    """A missing file named like a Shakespeare play (`hamlet`): the hint to write `shakespeare:hamlet`."""
    if os.sep in pattern or "/" in pattern:
        return ""
    from .samples import shakespeare_plays

    try:
        names = [p.name[: -len("_gut.txt")] for p in shakespeare_plays()]
    except AttnResError:
        return ""
    stem = Path(pattern).stem.lower().removesuffix("_gut")
    close = [stem] if stem in names else difflib.get_close_matches(stem, names, n=2)
    if not close:
        return ""
    return f"; for the Shakespeare play write {' or '.join(repr(SHAKESPEARE_PREFIX + name) for name in close)}"


def _no_play(wanted: str, plays: list[Path]) -> str:
    names = [p.name[: -len("_gut.txt")] for p in plays]
    close = difflib.get_close_matches(wanted, names, n=3)
    folder = plays[0].parent if plays else "the shakespeare package"
    hint = f"did you mean {' or '.join(repr(SHAKESPEARE_PREFIX + name) for name in close)}? " if close else ""
    return (
        f"no Shakespeare play matches {wanted!r}; {hint}names look like {', '.join(names[:4])}, ... "
        f"(shakespeare:* is every play; `ls {folder}` lists all {len(names)}: NAME_gut.txt)"
    )
