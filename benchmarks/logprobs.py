"""Memory-bounded logprobs: one training step with the head in chunks against all at once.

    python -m benchmarks.logprobs [--quick]      # or: forge bench logprobs

A Qwen3-family model with Qwen3's 151,936-token vocabulary and a small body (hidden 64, two
layers), fp32 on the CPU (bf16 on an accelerator), takes one training step as the trainer's:
token_logprobs with entropy, a loss weighing every token differently, backward. Each mode runs
in a fresh process; its peak memory is the step's high-water mark above what the process held
before it (the accelerator allocator's where there is one, else the resident set), its time the
median of 3 steps after one. The two modes' logprobs and gradients are compared (fp32 on the
CPU). Tokens: 16,384 in rows of 1,024 on an accelerator; 4,096 on the CPU, where all at once
needs ~4 copies of tokens x vocabulary in fp32 (10 GB at 4,096 tokens, 40 GB at 16,384);
--quick: 1,024, in chunks of 256. Writes benchmarks/results/logprobs.json (`peak_memory_ratio`,
`step_time_ratio`, `max_logprob_diff`, `max_grad_diff`).
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import ROOT, parse_args, write_result
from services import titan

GOAL = "peak memory ≤ 0.25 of all at once, step ≤ 1.1×"  # the target the manual's results page shows beside the figures

VOCAB = 151_936
ROW = 1024


def model_dir() -> Path:
    """A random Qwen3 checkpoint with the real vocabulary and a small body (cached)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = ROOT / ".cache/forge/models/bench-logprobs-qwen3-v151936-h64"
    if not (out / "model.safetensors").exists():
        config = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=ROW,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _step(model: torch.nn.Module, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    lp, _ = titan.token_logprobs(model, ids, with_entropy=True, chunk_tokens=chunk)
    weights = torch.linspace(-1, 1, ids.shape[1], device=ids.device)
    ((lp * weights).sum() / ids.numel()).backward()
    return lp.detach()


def measure(chunk: int, tokens: int) -> dict:
    """One mode in this (fresh) process: peak bytes of its first step, median step seconds,
    and the first step's logprobs and gradients (on the CPU)."""
    device = titan.default_device()
    accelerated = device.type != "cpu"
    model = titan.load_hf_model(model_dir(), device)
    if accelerated:
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (tokens // ROW, ROW), generator=torch.Generator().manual_seed(0)).to(device)
    if accelerated:
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats(device)
        before = torch.accelerator.memory_allocated(device)
    else:
        before = _resident_bytes()
    lp = _step(model, ids, chunk)
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    if accelerated:
        peak = torch.accelerator.max_memory_allocated(device) - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(3):
        start = time.perf_counter()
        _step(model, ids, chunk)
        if accelerated:
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return {
        "peak": peak,
        "seconds": statistics.median(times),
        "lp": lp.float().cpu(),
        "grads": grads,
        "device": str(device),
    }


def _fresh(chunk: int, tokens: int) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (chunk, tokens))


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("logprobs", __doc__, "1,024 tokens", argv)
    model_dir()  # made once, before the fresh processes read it
    accelerated = torch.accelerator.is_available()
    tokens = 1024 if a.quick else (16_384 if accelerated else 4096)
    chunk = 256 if a.quick else titan.LOGPROB_CHUNK  # the quick run's tokens in a few chunks too
    runs = {label: _fresh(c, tokens) for label, c in (("all at once", 0), (f"chunks of {chunk}", chunk))}
    plain, chunked = runs.values()
    grad_diff = max((plain["grads"][n] - chunked["grads"][n]).abs().max().item() for n in plain["grads"])
    result = {
        "device": plain["device"],
        "tokens": tokens,
        "vocab": VOCAB,
        "chunk_tokens": chunk,
        "peak_bytes": {label: r["peak"] for label, r in runs.items()},
        "step_seconds": {label: r["seconds"] for label, r in runs.items()},
        "peak_memory_ratio": chunked["peak"] / plain["peak"],
        "step_time_ratio": chunked["seconds"] / plain["seconds"],
        "max_logprob_diff": (plain["lp"] - chunked["lp"]).abs().max().item(),
        "max_grad_diff": grad_diff,
    }
    print(f"{tokens} tokens x {VOCAB} vocabulary, one training step on {result['device']}")
    print(f"{'':<22}{'peak MB':>12}{'step s':>10}")
    for label, r in runs.items():
        print(f"{label:<22}{r['peak'] / 2**20:>12.0f}{r['seconds']:>10.3f}")
    print(
        f"peak_memory_ratio {result['peak_memory_ratio']:.3f}  step_time_ratio {result['step_time_ratio']:.3f}  "
        f"max |d logprob| {result['max_logprob_diff']:.2e}  max |d grad| {grad_diff:.2e}"
    )
    return write_result(a.out, result)


if __name__ == "__main__":
    main()
