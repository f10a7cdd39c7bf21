"""vLLM loads the tiny model through its normal HF path (the generator service builds on this)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # 45 s; tests/test_generator.py checks the same ids, text and logprobs through the service
def test_vllm_loads_tiny_model(tiny_model_dir):
    # The compile cache survives between runs (engine creation is ~4x faster warm).
    os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache/forge/vllm"))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # CPU: vLLM's memory check cannot size the KV cache itself, so it is given explicitly.
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=256,
        enforce_eager=True,  # as forge's generator runs it; torch.compile added ~50 s here
    )
    try:
        out = llm.generate(
            ["12+7=", "rev abc="], SamplingParams(temperature=0, max_tokens=8, logprobs=0), use_tqdm=False
        )
        for req, prompt in zip(out, ["12+7=", "rev abc="]):
            assert list(req.prompt_token_ids) == tok(prompt)["input_ids"]
            c = req.outputs[0]
            assert 0 < len(c.token_ids) <= 8 and len(c.logprobs) == len(c.token_ids)
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
            assert all(lp[t].logprob <= 0.0 for lp, t in zip(c.logprobs, c.token_ids))
    finally:
        del llm


AMX_PERMITTED = """
import ctypes
import services.vllm_worker
flags = ctypes.c_ulong()
ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(flags))  # arch_prctl(ARCH_GET_XCOMP_PERM)
print(bool(flags.value & 1 << 18))  # XTILEDATA: AMX's tile registers
"""


@pytest.mark.skipif(
    "amx_tile" not in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""),
    reason="no AMX on this CPU",
)
def test_vllm_worker_may_use_amx_tiles():
    """A bfloat16 generator on an AMX CPU (`forge bench mismatch`'s): vLLM's attention kernel runs AMX tile
    instructions, which Linux answers with SIGILL in a process that has not asked for them (oneDNN
    asks only for a large enough matmul; the generator's 1-token warm-up ran none first)."""
    root = Path(__file__).parents[1]
    r = subprocess.run([sys.executable, "-c", AMX_PERMITTED], capture_output=True, text=True, cwd=root)
    assert r.stdout.split()[-1:] == ["True"], r.stderr[-2000:]
