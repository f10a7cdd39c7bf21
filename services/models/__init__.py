"""Model families, keyed by the `model_type` of an HF config.json: the one place that knows a
family. A new family is a module here and a line in `FAMILIES`.

    family = models.of(hf_config)          # by config.json's model_type ("llama"); by forge's name: models.get("llama3")
    cfg = family.titan_config(hf_config, device_type)       # torchtitan's model args
    model = cfg.build(); model.load_state_dict(family.adapter(cfg).from_hf(hf_state))
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.models import hf, llama3, qwen3, qwen3_moe


@dataclass(frozen=True)
class ModelFamily:
    name: str  # forge's (`model.family`, `forge make-tiny-model --family`)
    model_type: str  # config.json's
    titan_config: Callable[[dict, str], Any]  # (HF config, device type) -> torchtitan model config
    adapter: Callable[[Any], Any]  # (torchtitan model config) -> its state-dict adapter (from_hf, to_hf)
    parallelize: Callable[..., Any]  # torchtitan's parallelize function (FSDP2, activation checkpointing)
    tiny: Callable[[Any, Any], Any]  # (TinyModelSpec, tokenizer) -> a small HF model of the family
    build: Callable[[Any], Any] = lambda cfg: cfg.build()  # (its model config) -> the model, on the current device


def _keys_named(titan_config: Callable[[dict, str], Any]) -> Callable[[dict, str], Any]:
    """`titan_config` whose missing config.json key is an error naming the key and the file, not
    a KeyError: a family reads what transformers' config classes require of its checkpoints."""

    @functools.wraps(titan_config)
    def named(hf: dict, device_type: str = "cpu") -> Any:
        try:
            return titan_config(hf, device_type)
        except KeyError as e:
            where = Path(hf.get("_name_or_path", ".")) / "config.json"
            raise ValueError(f"{where}: key {e} is missing (needed to build the model)") from None

    return named


FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in (
        ModelFamily(
            "qwen3", "qwen3", _keys_named(qwen3.titan_config), qwen3.adapter, qwen3.parallelize, qwen3.tiny_model
        ),
        ModelFamily(
            "llama3", "llama", _keys_named(llama3.titan_config), llama3.adapter, llama3.parallelize, llama3.tiny_model
        ),
        ModelFamily(
            "qwen3_moe",
            "qwen3_moe",
            _keys_named(qwen3_moe.titan_config),
            qwen3_moe.adapter,
            qwen3_moe.parallelize,
            qwen3_moe.tiny_model,
        ),
    )
}
# Any other dense causal LM transformers knows: its own modeling code in torchtitan (hf.py).
FALLBACK = ModelFamily("hf", "*", hf.titan_config, hf.adapter, hf.parallelize, hf.tiny_model, hf.build)
NAMES: dict[str, ModelFamily] = {f.name: f for f in (*FAMILIES.values(), FALLBACK)}


def get(name: str | None, where: str = "model.tiny.family") -> ModelFamily:
    """The family forge calls `name`, or an error naming `where` it came from and the families known."""
    if name not in NAMES:
        raise ValueError(f"{where}: family {name!r} is not supported (supported: {', '.join(NAMES)})")
    return NAMES[name]


def of(hf_config: dict[str, Any], where: str = "config.json") -> ModelFamily:
    """The family of an HF config (its `model_type`), or an error naming `where` it came from."""
    model_type = hf_config.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if hf.supports(hf_config):
        return FALLBACK
    known = ", ".join(f"{t} ({f.name})" for t, f in FAMILIES.items())
    raise ValueError(
        f"{where}: model_type {model_type!r} is not supported (supported: {known}, and any other dense causal LM "
        "transformers has, through torchtitan's transformers backend (hf))"
    )


def hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The config.json of the HF model in `model_dir`, of a family forge knows (else an error
    naming the file)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    hf_config = json.loads(path.read_text())
    # Where the checkpoint is (HF's own key): the hf family's backend reads the config from there.
    hf_config["_name_or_path"] = str(model_dir)
    of(hf_config, str(path))
    return hf_config


def of_model(model_dir: str | Path) -> ModelFamily:
    """The family of the HF model in `model_dir` (its config.json's model_type)."""
    return of(hf_config(model_dir))
