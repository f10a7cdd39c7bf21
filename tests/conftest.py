import asyncio
import os
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# The test's processes print where pytest shows them (tests of runs/NAME/logs run `forge` without it).
os.environ.setdefault("FORGE_LOGS", "console")


def as_a_user(env: dict[str, str]) -> dict[str, str]:
    """`env` without what the tests set for their own processes: a command run with it puts its
    libraries' output in runs/.../logs, as for a user."""
    return {k: v for k, v in env.items() if k not in ("FORGE_LOGS", "VLLM_LOGGING_LEVEL")}


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not); one that ends while it is asked did not."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Monarch children import test actors (tests/*_actors.py) by module name.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(ROOT), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model (random init), cached under .cache/ like every forge build."""
    from services.schema import TinyModelSpec
    from services.tiny_model import make_tiny_model

    return make_tiny_model(ROOT / ".cache/forge/models/test-tiny", TinyModelSpec(sft_steps=0))


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """The tiny model of the llama3 family (random init, Llama 3's rope scaling), cached like it."""
    from services.schema import TinyModelSpec
    from services.tiny_model import make_tiny_model

    return make_tiny_model(ROOT / ".cache/forge/models/test-tiny-llama3", TinyModelSpec(family="llama3"))


@pytest.fixture(scope="session")
def tiny_moe_dir() -> Path:
    """The tiny model of the qwen3_moe family (random init: 4 experts, 2 per token)."""
    from services.schema import TinyModelSpec
    from services.tiny_model import make_tiny_model

    return make_tiny_model(ROOT / ".cache/forge/models/test-tiny-qwen3_moe", TinyModelSpec(family="qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_hf_dir() -> Path:
    """The tiny model of the hf family (any other causal LM, through torchtitan's transformers
    backend): a Qwen2, random init."""
    from services.schema import TinyModelSpec
    from services.tiny_model import make_tiny_model

    return make_tiny_model(ROOT / ".cache/forge/models/test-tiny-hf", TinyModelSpec(family="hf"))


@pytest.fixture(scope="session")
def loop():
    """One event loop for services that outlive a test (one vLLM engine per module or session)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def served(loop, tiny_model_dir):
    """The gateway with the hermes tool parser (the tiny model), its generator, the store the
    generator loads from and the WeightSync that tells it of new versions, shared by a module's tests. Per module, not per session: TorchStore is
    one per process, and tests elsewhere start their own."""

    from forge.store import WeightStore, start_store, stop_store
    from forge.weight_sync import WeightSync
    from services.gateway import Gateway
    from services.generator import Generator
    from services.schema import GatewayConfig, GeneratorConfig

    async def start():
        store = await start_store()
        weights = WeightStore("gateway-test")
        cfg = GeneratorConfig(max_model_len=512)
        gen = await Generator.options().as_service(str(tiny_model_dir), cfg, weights)
        sync = WeightSync(None, gen)  # the tests publish, as a trainer would
        await sync.start()
        gw = await Gateway.start(
            gen, tiny_model_dir, GatewayConfig(tool_parser="hermes", served_model_name="tiny"), cfg
        )
        return store, weights, gen, sync, gw

    store, weights, gen, sync, gw = loop.run_until_complete(start())
    yield gw, gen, weights, sync
    loop.run_until_complete(sync.stop())
    loop.run_until_complete(gw.shutdown())
    loop.run_until_complete(weights.clear())
    loop.run_until_complete(gen.shutdown())
    loop.run_until_complete(stop_store(store))
