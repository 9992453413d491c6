import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    from attnres_convert.errors import SourceError
    from attnres_convert.samples import default_model_path

    try:
        return default_model_path()
    except SourceError as error:
        pytest.skip(f"real-model test needs the embedded model: {error}")
