"""vLLM loads the tiny model through its normal HF path (the generator service builds on this)."""

import os
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
