"""Prefix-shared packing: one GRPO training step with each group's prompt once per row against a
row per sample (forge.types.collate's `share_prefix="always"`; by default a group shares only
where its row attends over fewer token pairs, which the `group` shape does and `agentic` not).

    python -m benchmarks.prefix [--quick]      # or: forge bench prefix

Two batch shapes: `group`, a 512-token prompt and 8 completions of 32 tokens (a group of GRPO
samples); `agentic`, a group of 8 four-turn episodes after a shared 256-token prompt (32 of the
model's tokens a turn, 32 of the environment's between turns: a multi-turn episode is one
sequence already, so what a group shares is its first prompt). The step is the trainer's:
token_logprobs with entropy, the GRPO loss with its k3 KL to a reference, backward, an AdamW
step; fp32 on the CPU (bf16 on an accelerator). Each model's two layouts run in one process,
alternating, the median of 3 steps after one each; their first step's loss-token logprobs and
gradients are compared (fp32, before any optimizer step). Models: the tiny one (2.4M) and the
60M one of `forge bench gateway`. --quick: the tiny model, a 128-token prompt. Writes
benchmarks/results/prefix.json (`step_speedup` per model and shape, `max_logprob_diff`,
`max_grad_diff`).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import parse_args, tiny_model, write_result
from benchmarks.gateway import MODELS
from forge.losses import get_loss
from forge.schema import LossConfig
from forge.types import Batch, Episode, collate
from services import models, titan

GOAL = "`step_speedup` ≥ 3 (512-token prompt, 8 × 32-token completions, 60M model); the same logprobs and gradients"  # the target the manual's results page shows beside the figures

GROUP, COMPLETION, TURNS = 8, 32, 4
LOSS = LossConfig(name="grpo", kl_coef=0.01)


def group(vocab: int, prompt: int, seed: int = 0) -> list[Episode]:
    """A prompt of `prompt` tokens and GROUP completions of COMPLETION tokens."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, vocab, (prompt,), generator=g).tolist()
    episodes = []
    for k in range(GROUP):
        own = torch.randint(1, vocab, (COMPLETION,), generator=g).tolist()
        episodes.append(
            Episode(
                tokens=shared + own,
                loss_mask=[0] * prompt + [1] * COMPLETION,
                gen_logprobs=[0.0] * prompt + [-1.0] * COMPLETION,
                advantage=(k - GROUP / 2) / GROUP,
            )
        )
    return episodes


def agentic(vocab: int, prompt: int, seed: int = 0) -> list[Episode]:
    """GROUP episodes of TURNS turns after one prompt: the model's turns (loss) and the
    environment's replies (no loss) between them."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, vocab, (prompt,), generator=g).tolist()
    episodes = []
    for k in range(GROUP):
        tokens, mask = list(shared), [0] * prompt
        for turn in range(TURNS):
            tokens += torch.randint(1, vocab, (COMPLETION,), generator=g).tolist()
            mask += [1] * COMPLETION
            if turn < TURNS - 1:
                tokens += torch.randint(1, vocab, (COMPLETION,), generator=g).tolist()
                mask += [0] * COMPLETION
        logprobs = [-1.0 * m for m in mask]
        episodes.append(Episode(tokens, mask, logprobs, advantage=(k - GROUP / 2) / GROUP))
    return episodes


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, b: Batch) -> tuple:
    """The trainer's step on `b`: its loss tokens' logprobs (in episode order) and, without an
    optimizer, every gradient; with one, the step taken."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # the reference: these weights (the KL term's cost, as a reference service's)
        b.ref_logprobs = titan.token_logprobs(model, b.input_ids, positions=b.positions, segments=b.segments)[0]
    lp, _ = titan.token_logprobs(model, b.input_ids, with_entropy=True, positions=b.positions, segments=b.segments)
    get_loss(LOSS.name)(lp, b, torch.ones_like(lp), LOSS).backward()
    if optimizer is not None:
        optimizer.step()
        return ()
    own = b.loss_mask > 0
    positions = (
        b.positions
        if b.positions is not None
        else torch.arange(b.input_ids.shape[1], device=b.input_ids.device).expand_as(b.doc_ids)
    )
    order = torch.argsort(b.doc_ids[own] * 100_000 + positions[own])
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    return lp[own][order].detach().float().cpu(), grads


def measure(model_dir: str, episodes: list[Episode]) -> dict:
    """Both layouts of `episodes` on one model: tokens, median step seconds, and how far apart
    their logprobs and gradients are."""
    device = titan.default_device()
    model = titan.load_hf_model(model_dir, device)
    if device.type != "cpu":
        model = model.to(torch.bfloat16)
    batches = {
        "a row per sample": collate(episodes, pad_id=0),
        "prompt shared": collate(episodes, pad_id=0, share_prefix="always"),
    }
    batches = {k: b.to(device) for k, b in batches.items()}
    (lp0, g0), (lp1, g1) = (train_step(model, None, b) for b in batches.values())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times: dict[str, list[float]] = {k: [] for k in batches}
    for i in range(4):  # the first of each is warm-up
        for label, b in batches.items():
            start = time.perf_counter()
            train_step(model, optimizer, b)
            if device.type != "cpu":
                torch.accelerator.synchronize()
            if i:
                times[label].append(time.perf_counter() - start)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    return {
        "tokens": {k: int(b.input_ids.numel()) for k, b in batches.items()},
        "step_seconds": seconds,
        "step_speedup": seconds["a row per sample"] / seconds["prompt shared"],
        "max_logprob_diff": (lp0 - lp1).abs().max().item(),
        "max_grad_diff": max((g0[n] - g1[n]).abs().max().item() for n in g0),
        "device": str(device),
    }


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("prefix", __doc__, "the tiny model, a 128-token prompt", argv)
    names = ["tiny_2.4M"] if a.quick else list(MODELS)
    prompt = 128 if a.quick else 512
    shapes = {"group": (group, prompt), "agentic": (agentic, prompt // 2)}
    rows: dict[str, dict] = {}
    print(f"{'model':<12}{'shape':<10}{'tokens: row/sample':>20}{'shared':>8}{'step s':>9}{'shared':>9}{'speedup':>9}")
    for name in names:
        model_dir = tiny_model(**MODELS[name][0], max_position_embeddings=1024)  # a 544-token episode
        vocab = models.hf_config(model_dir)["vocab_size"]
        for shape, (make, length) in shapes.items():
            r = measure(model_dir, make(vocab, length))
            rows[f"{name}/{shape}"] = r
            (t0, t1), (s0, s1) = r["tokens"].values(), r["step_seconds"].values()
            print(f"{name:<12}{shape:<10}{t0:>20}{t1:>8}{s0:>9.3f}{s1:>9.3f}{r['step_speedup']:>9.2f}")
    worst_lp = max(r["max_logprob_diff"] for r in rows.values())
    worst_grad = max(r["max_grad_diff"] for r in rows.values())
    print(f"max |d logprob| {worst_lp:.2e}  max |d grad| {worst_grad:.2e}")
    result = {
        "prompt_tokens": prompt,
        "group": GROUP,
        "completion_tokens": COMPLETION,
        "rows": rows,
        "step_speedup": {k: r["step_speedup"] for k, r in rows.items()},
        "max_logprob_diff": worst_lp,
        "max_grad_diff": worst_grad,
    }
    return write_result(a.out, result)


if __name__ == "__main__":
    main()
