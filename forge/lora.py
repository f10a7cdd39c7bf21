"""LoRA adapters as forge's pieces exchange them: the config (`trainer.lora`) and PEFT's file
format (`adapter_config.json` + `adapter_model.safetensors`), which the trainer exports, the
generator hands vLLM for each policy version, and `peft` and `forge serve --lora` load.

    cfg = LoRAConfig(rank=8, alpha=16)           # rank 0: off (a full fine-tune)
    write_adapter(out_dir, tensors, cfg, base)   # tensors named by `peft_key(module, "A")`
    cfg, tensors = read_adapter(out_dir)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from forge.config import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Every linear of attention and MLP, in HF's names (PEFT's `target_modules`).
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    """Low-rank adapters on the target linears; the base weights stay frozen."""

    rank: int = 0  # 0: off, every weight trains
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, while training
    targets: list[str] = field(default_factory=lambda: list(ALL_LINEAR))  # HF module names

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self, key: str = "trainer.lora") -> None:
        if self.rank < 0:
            raise ConfigError(f"config key '{key}.rank' must be >= 0 (0: off), got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"config key '{key}.dropout' must be in [0, 1), got {self.dropout}")
        if self.enabled and not self.targets:
            raise ConfigError(f"config key '{key}.targets' names no module to adapt")


def peft_key(hf_module: str, which: str) -> str:
    """PEFT's name of the A or B matrix of the adapter on `hf_module` (e.g. model.layers.0.self_attn.q_proj)."""
    return f"base_model.model.{hf_module}.lora_{which}.weight"


def write_adapter(out: str | Path, tensors: dict[str, torch.Tensor], cfg: LoRAConfig, base_model: str) -> Path:
    """A PEFT adapter directory: `tensors` (PEFT-named) and the config that says how to apply them."""
    from peft import LoraConfig  # its config class writes the file peft and vLLM read

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=modules,
        base_model_name_or_path=base_model,
        task_type="CAUSAL_LM",
    ).save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def read_adapter(path: str | Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A PEFT adapter directory: its config (rank, alpha, dropout, targets) and its tensors."""
    path = Path(path)
    peft = json.loads((path / ADAPTER_CONFIG).read_text())
    targets = peft.get("target_modules") or []
    cfg = LoRAConfig(
        rank=peft["r"],
        alpha=peft.get("lora_alpha", peft["r"]),
        dropout=peft.get("lora_dropout", 0.0),
        targets=sorted(targets) if isinstance(targets, list) else [targets],
    )
    return cfg, load_file(str(path / ADAPTER_WEIGHTS))
