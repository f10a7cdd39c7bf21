import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model (random init), cached under .cache/ like every forge build."""
    from forge.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(ROOT / ".cache/forge/models/test-tiny", TinyModelSpec(sft_steps=0))
