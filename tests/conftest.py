import asyncio
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# Monarch children import test actors (tests/*_actors.py) by module name.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(ROOT), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model (random init), cached under .cache/ like every forge build."""
    from forge.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(ROOT / ".cache/forge/models/test-tiny", TinyModelSpec(sft_steps=0))


@pytest.fixture(scope="module")
def loop():
    """One event loop for a module whose services outlive a test (one vLLM engine per module)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
