"""LoRA in the trainer: torchtitan's LoRA converter on a family's model config, the adapter's
tensors in PEFT's names (what the generator and `peft` load), the base model back (adapters off:
the reference for free) and the merged weights.

    cfg = adapt(family.titan_config(hf, "cpu"), family, LoRAConfig(rank=8))   # before the model is built
    names = PeftNames(model, family.adapter(cfg))
    tensors = names.tensors(model)            # {base_model.model.<hf module>.lora_A.weight: ...}
    with adapters_off(model): ...             # the frozen base's forward
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from forge.config import ConfigError
from forge.lora import peft_key
from forge.schema import LoRAConfig


def lora_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(fqn, module) of every linear that carries an adapter (torchtitan's LoRALinear)."""
    for name, module in model.named_modules():
        if hasattr(module, "_lora_scaling"):
            yield name, module


def adapt(titan_cfg: Any, family: Any, lora: LoRAConfig) -> Any:
    """`titan_cfg` (a family's torchtitan model config) with adapters on `lora.targets` (HF
    module names, mapped to torchtitan's through the family's state-dict adapter) and every other
    weight frozen."""
    from torchtitan.components.lora import LoRAConverter

    hf_map = getattr(family.adapter(titan_cfg), "from_hf_map", None)
    if hf_map is None:
        raise ConfigError(f"config key 'trainer.lora': LoRA is not supported for the {family.name} family")
    # HF module -> torchtitan module, for the linears (not norms or embeddings; a MoE's grouped
    # experts are not Linear).
    names = {
        hf.split(".")[-2]: titan.split(".")[-2]
        for hf, titan in hf_map.items()
        if titan
        and hf.endswith(".weight")
        and titan.endswith(".weight")
        and not any(part in hf for part in (".experts.", "norm", "embed"))
    }
    unknown = [t for t in lora.targets if t not in names]
    if unknown:
        raise ConfigError(
            f"config key 'trainer.lora.targets': {unknown} are not linears of a {family.name} model "
            f"(it has {', '.join(sorted(names))})"
        )
    # torchtitan builds wk and wv from one config (`wkv`): they take adapters together.
    if len({"k_proj", "v_proj"} & set(lora.targets)) == 1:
        raise ConfigError(
            "config key 'trainer.lora.targets': k_proj and v_proj are adapted together; name both or neither"
        )
    titan = {hf: "wkv" if t in ("wk", "wv") else t for hf, t in names.items()}
    targets = sorted({titan[t] for t in lora.targets})
    linears = _linears(titan_cfg)
    if not linears & set(targets):  # nothing would train
        has = sorted(hf for hf, t in titan.items() if t in linears)
        raise ConfigError(
            f"config key 'trainer.lora.targets': {lora.targets} adapt no linear of this {family.name} model "
            f"(it can adapt {', '.join(has)})"
        )
    converter = LoRAConverter(LoRAConverter.Config(rank=lora.rank, alpha=lora.alpha, target_modules=targets))
    return converter.convert(titan_cfg)


def _linears(titan_cfg: Any) -> set[str]:
    """The last names of the linears `titan_cfg` builds (what LoRAConverter's targets match)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.protocols.module import Module

    return {
        fqn.rsplit(".", 1)[-1]
        for fqn, c, _, _ in titan_cfg.traverse(Module.Config, recurse=True)
        if isinstance(c, Linear.Config)
    }


def add_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on each adapter's input while training (PEFT's lora_dropout); torchtitan's LoRA
    linear has none, so a pre-hook on its A matrix adds it. The trainer's model stays in training
    mode: a forward without gradients (logprobs, a critic's values) is an eval's, without dropout."""
    if p <= 0:
        return
    for _, module in lora_modules(model):
        module.lora_a.register_forward_pre_hook(
            lambda m, args: (
                torch.nn.functional.dropout(args[0], p, m.training and torch.is_grad_enabled()),
                *args[1:],
            )
        )


def is_adapter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward: each adapter scaled by 0 (base + 0 is the base, exactly)."""
    held = [(m, m._lora_scaling) for _, m in lora_modules(model)]
    try:
        for m, _ in held:
            m._lora_scaling = 0.0
        yield
    finally:
        for m, scaling in held:
            m._lora_scaling = scaling


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class PeftNames:
    """Each adapted linear's HF module name, and the order HF gives the rows of its weight: a
    family's adapter may permute them (Llama's q and k, for RoPE), and B's rows follow them. The
    order is read by converting a weight of row numbers, so any family's adapter says it itself."""

    def __init__(self, model: torch.nn.Module, state_dict_adapter: Any):
        self.modules: dict[str, tuple[str, torch.Tensor]] = {}
        orders: dict[str, tuple[str, torch.Tensor]] = {}  # per layer-free name: layers share their order
        for name, module in lora_modules(model):
            abstract = re.sub(r"\d+", "{}", name, count=1)
            if abstract not in orders:
                rows, cols = module.weight.shape
                numbered = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, cols).contiguous()
                converted = state_dict_adapter.to_hf({f"{name}.weight": numbered})
                if (
                    not converted
                ):  # a head tied to the embeddings, which the adapter leaves out: HF's name, rows as they are
                    hf_names = {titan: hf for hf, titan in state_dict_adapter.from_hf_map.items() if titan}
                    converted = {hf_names[f"{abstract}.weight"].replace("{}", "0", 1): numbered}
                ((hf_key, value),) = converted.items()
                orders[abstract] = (re.sub(r"\d+", "{}", hf_key.removesuffix(".weight"), count=1), value[:, 0].long())
            hf_pattern, order = orders[abstract]
            layer = re.search(r"\d+", name)
            self.modules[name] = (hf_pattern.replace("{}", layer.group(0), 1) if layer else hf_pattern, order)

    def tensors(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The adapter in PEFT's names, whole (every rank must call this: FSDP gathers), on the CPU."""
        out = {}
        for name, module in lora_modules(model):
            hf_name, order = self.modules[name]
            out[peft_key(hf_name, "A")] = _full(module.lora_a.weight.detach()).cpu()
            out[peft_key(hf_name, "B")] = _full(module.lora_b.weight.detach()).cpu()[order]
        return out


def merged(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict (torchtitan names) with each adapter folded into its base weight and removed."""
    out = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    for key in [k for k in state_dict if k.endswith(".lora_a.weight")]:
        prefix = key.removesuffix(".lora_a.weight")
        a, b = state_dict[key], state_dict[f"{prefix}.lora_b.weight"]
        out[f"{prefix}.weight"] = out[f"{prefix}.weight"] + scaling * (b.float() @ a.float()).to(a.dtype)
    return out


class AdapterState:
    """What trains as DCP state (torch's Stateful protocol): the adapters, and a score head (a
    critic's, a reward model's: new, so not in the base). A LoRA checkpoint holds them, their
    optimizer state and the schedule, and the base comes from the model path."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if is_adapter(n) or p.requires_grad}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.state_dict().items():
                if state_dict[name] is not param:  # DCP loads into these very tensors
                    param.copy_(state_dict[name])
