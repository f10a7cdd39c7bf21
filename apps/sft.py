"""Supervised fine-tuning of a (tiny) model on a toy task, with held-out evaluation.

python -m apps.sft --config configs/sft_tiny.yaml [key=value ...]
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge import tasks
from forge.config import ConfigError, to_yaml
from forge.metrics import MetricWriter
from forge.tiny_model import ModelConfig, evaluate, sft


@dataclass
class Config:
    app: str = "sft"
    run_name: str = "sft_tiny"
    runs_dir: str = "runs"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    task: str = "add"
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    eval_every: int = 50
    eval_samples: int = 128
    metrics: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])

    def validate(self) -> None:
        if self.task not in tasks.TASKS:
            raise ConfigError(f"config key 'task': unknown task {self.task!r}; known: {', '.join(sorted(tasks.TASKS))}")
        for key in ("steps", "batch_size", "eval_every", "eval_samples"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' must be >= 1, got {getattr(self, key)}")


def main(cfg: Config) -> dict[str, float]:
    run_dir = Path(cfg.runs_dir) / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    torch.manual_seed(cfg.seed)

    model_dir = cfg.model.resolve()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    metrics = MetricWriter(run_dir, cfg.metrics)
    # One optimizer and one data stream for the whole run: eval chunks must not reset them.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(f"sft:{cfg.task}:{cfg.seed}")

    result = evaluate(model, tokenizer, cfg.task, cfg.eval_samples)
    metrics.write(0, {"eval_reward": result["reward"], "eval_accuracy": result["accuracy"]})
    bar = tqdm(range(0, cfg.steps, cfg.eval_every), desc="sft", unit="chunk")
    for done in bar:
        n = min(cfg.eval_every, cfg.steps - done)
        losses = sft(model, tokenizer, cfg.task, n, cfg.batch_size, opt, rng)
        result = evaluate(model, tokenizer, cfg.task, cfg.eval_samples)
        row = {"loss": sum(losses) / n, "eval_reward": result["reward"], "eval_accuracy": result["accuracy"]}
        metrics.write(done + n, row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{result['accuracy']:.2f}")
    metrics.close()
    model.save_pretrained(run_dir / "model")
    tokenizer.save_pretrained(run_dir / "model")
    print(
        f"sft: {cfg.task} accuracy {result['accuracy']:.2f}, reward {result['reward']:.3f}; model in {run_dir / 'model'}"
    )
    return result


if __name__ == "__main__":
    from forge.cli import run_app

    run_app("sft")
