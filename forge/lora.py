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
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from forge.schema import ADAPTER_CONFIG, LoRAConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's tensor names: PREFIX + the module's name in the model
# PEFT options vLLM cannot serve (its PEFTHelper refuses them): the adapter computes more than its
# A and B matrices, or trains weights of the model beside them.
UNSERVABLE = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "trainable_token_indices",
    "layer_replication",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)
# init_lora_weights that only draw the adapter's first weights; the others (pissa, olora, corda,
# loftq) change the base model's when PEFT loads the adapter, which vLLM's base does not see.
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
DEFAULT_ALPHA = 8  # PEFT's LoraConfig.lora_alpha, where adapter_config.json leaves it out
PLAIN_TENSOR = re.compile(rf"{re.escape(PREFIX)}.+\.lora_[AB]\.weight")  # what write_adapter writes back


def peft_key(hf_module: str, which: str) -> str:
    """PEFT's name of the A or B matrix of the adapter on `hf_module` (e.g. model.layers.0.self_attn.q_proj)."""
    return f"{PREFIX}{hf_module}.lora_{which}.weight"


def _module_ranks(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each adapted module's name in the model -> its adapter's rank (the rows of its A)."""
    return {k.removeprefix(PREFIX).split(".lora_A.")[0]: t.shape[0] for k, t in tensors.items() if ".lora_A." in k}


def write_adapter(out: str | Path, tensors: dict[str, torch.Tensor], cfg: LoRAConfig, base_model: str) -> Path:
    """A PEFT adapter directory: `tensors` (PEFT-named) and the config that says how to apply them:
    each module's output scaled by `cfg`'s alpha / rank, whatever the rank of its own tensors."""
    from peft import LoraConfig  # its config class writes the file peft and vLLM read

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    # A module of another rank (read from a user's adapter with a rank_pattern): its rank, and the
    # alpha that keeps its scaling cfg's.
    other = {re.escape(m): r for m, r in _module_ranks(tensors).items() if r != cfg.rank}
    LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=modules,
        rank_pattern=other,
        alpha_pattern={m: cfg.alpha * r / cfg.rank for m, r in other.items()},
        base_model_name_or_path=base_model,
        task_type="CAUSAL_LM",
    ).save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """The adapter_config.json of the PEFT adapter directory `path`, with its ranks (`r`, and
    `rank_pattern`'s) checked: positive ints. ValueError naming the file and key otherwise."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        peft = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file}: not JSON ({e})") from None
    if not isinstance(peft, dict):
        raise ValueError(f"{file}: not a PEFT adapter config (a JSON object)")
    ranks = {"r": peft.get("r"), **{f"rank_pattern.{k}": r for k, r in (peft.get("rank_pattern") or {}).items()}}
    for key, r in ranks.items():
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"{file}: key {key!r} (the adapter's rank) must be a positive int, got {r!r}")
    return peft


def adapter_rank(path: str | Path) -> int:
    """The largest rank of the PEFT adapter directory `path` (`r`, or a rank_pattern's): vLLM's slots must hold it."""
    peft = read_config(path)
    return max([peft["r"], *(peft.get("rank_pattern") or {}).values()])


def _check_servable(peft: dict[str, Any], file: Path) -> None:
    found = {key: peft[key] for key in UNSERVABLE if peft.get(key)}
    if peft.get("peft_type", "LORA") != "LORA":  # AdaLoRA's, LoHa's, ...: other tensors, other maths
        found["peft_type"] = peft["peft_type"]
    if peft.get("bias", "none") != "none":
        found["bias"] = peft["bias"]
    init = peft.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        found["init_lora_weights"] = init
    if found:
        keys = ", ".join(f"key {key!r} is {value!r}" for key, value in found.items())
        raise ValueError(f"{file}: {keys}: vLLM cannot serve such an adapter (plain LoRA only)")


def _scaling(peft: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of the adapter of `rank` on `module`: its alpha (alpha_pattern's first key
    matching the module, as PEFT's get_pattern_key matches, else lora_alpha) over its rank, or
    over the rank's square root with use_rslora."""
    alpha = peft.get("lora_alpha", DEFAULT_ALPHA)
    for key, value in (peft.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if peft.get("use_rslora") else rank)


def read_adapter(path: str | Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A PEFT adapter directory: its config (rank, alpha, dropout, targets) and its tensors. Each
    module's B carries what PEFT's scaling of it differs by from the config's alpha / rank
    (use_rslora, rank_pattern, alpha_pattern), so `write_adapter` gives back the same adapter.
    An adapter vLLM cannot serve (DoRA, AdaLoRA, tensors besides A and B, ...) is a ValueError
    naming its file and key. Without `lora_alpha`, alpha is PEFT's default (8)."""
    path = Path(path)
    peft = read_config(path)
    _check_servable(peft, path / ADAPTER_CONFIG)
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    other = sorted(k for k in tensors if not PLAIN_TENSOR.fullmatch(k))
    if other:
        raise ValueError(f"{path / ADAPTER_WEIGHTS}: {other[:3]} are not LoRA A or B matrices (plain LoRA only)")
    ranks = _module_ranks(tensors)
    targets = peft.get("target_modules") or []
    cfg = LoRAConfig(
        rank=max(ranks.values(), default=peft["r"]),
        alpha=peft.get("lora_alpha", DEFAULT_ALPHA),
        dropout=peft.get("lora_dropout", 0.0),
        targets=sorted(targets) if isinstance(targets, list) else [targets],
    )
    for module, rank in ranks.items():
        factor = _scaling(peft, module, rank) / cfg.scaling
        key = f"{PREFIX}{module}.lora_B.weight"
        if factor != 1.0 and key in tensors:
            tensors[key] = (tensors[key].float() * factor).to(tensors[key].dtype)
    return cfg, tensors
