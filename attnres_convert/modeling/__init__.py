"""The code shipped next to converted weights.

Every `.py` file in this folder except this one, and the C++ source of the CPU kernels, is copied into a
converted model's folder, where `from_pretrained(..., trust_remote_code=True)` imports it without this package
installed. So these files import only torch, transformers, the standard library and each other (relative imports).
"""

from pathlib import Path

SHIPPED_SUFFIXES = (".py", ".cpp")
SHIPPED_CODE = tuple(
    sorted(p.name for p in Path(__file__).parent.iterdir() if p.suffix in SHIPPED_SUFFIXES and p.name != "__init__.py")
)
