"""LoRA adapters as forge's pieces exchange them: the config (`trainer.lora`, a
`forge.schema.LoRAConfig`) and PEFT's file format (`adapter_config.json` +
`adapter_model.safetensors`), which the trainer exports, the generator hands vLLM for each
policy version, and `peft` and `forge serve --lora` load.

    cfg = LoRAConfig(rank=8, alpha=16)           # rank 0: off (a full fine-tune)
    write_adapter(out_dir, tensors, cfg, base)   # tensors named by `peft_key(module, "A")`
    cfg, tensors = read_adapter(out_dir)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from forge.schema import ADAPTER_CONFIG, LoRAConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"


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
