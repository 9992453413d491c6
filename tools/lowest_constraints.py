"""Print a constraints file that pins every dependency pyproject.toml declares (the test extra included) to
its lower bound: `make test-lowest` installs the project with it, so the bounds we declare are bounds we test.

A dependency without a lower bound is left to the resolver. Run from the repository root:
`python tools/lowest_constraints.py > .venv-lowest/constraints.txt`."""

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# torch is pinned by the Makefile's TORCH_SPEC (a local CPU wheel), whatever the range says.
PINNED_ELSEWHERE = {"torch"}


def lower_bounds(pyproject: dict) -> list[str]:
    project = pyproject["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    pins = []
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*([^;]*)(;.*)?$", requirement)
        name, spec, marker = match.group(1), match.group(2), match.group(3) or ""
        lowest = re.search(r">=\s*([^,\s]+)", spec)
        if lowest and name.lower() not in PINNED_ELSEWHERE:
            pins.append(f"{name}=={lowest.group(1)}{marker}")
    return pins


if __name__ == "__main__":
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    sys.stdout.write("".join(pin + "\n" for pin in lower_bounds(pyproject)))
