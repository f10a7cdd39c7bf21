"""Several LoRA adapters trained on one trainer model, one at a time: each tenant (a Tinker
training client) has its own adapter, gradients, optimizer state and rank.

The model carries adapters of the largest rank on every linear and the head (built once). A
tenant of rank r holds A's first r rows and B's first r columns; the rest of both are zeros, and
so are the adapters of the modules it does not train: with A's and B's unused parts both 0,
neither gets a gradient (dB = dy (A x), dA = (B^T dy) x), so AdamW leaves them 0 and the adapter
is exactly a rank-r adapter on the tenant's modules. `activate` swaps a tenant's tensors into the
model's parameters (a copy of a few MB; none while the same tenant goes on).

    tenants = Tenants(model, peft_names, build_optimizer)
    tenants.add("m1", rank=8, alpha=32, modules={"q_proj", ...}, seed=0)
    tenants.activate("m1")            # the model is m1's; forward, backward, step
    tensors, lora = tenants.adapter("m1")   # rank-8 PEFT tensors of its modules (every rank calls)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from forge.schema import LoRAConfig
from services.lora import PeftNames, lora_modules
from services.titan import reshard

MLP = ("gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
UNEMBED = ("lm_head",)


def modules_of(train_mlp: bool, train_attn: bool, train_unembed: bool) -> set[str]:
    """The HF module names a tenant adapts, by Tinker's three switches."""
    return {*(MLP if train_mlp else ()), *(ATTENTION if train_attn else ()), *(UNEMBED if train_unembed else ())}


@dataclass
class Tenant:
    rank: int
    alpha: float
    modules: set[str]  # HF module names it adapts (the rest stay 0)
    optimizer: Any  # its own torchtitan OptimizersContainer over the model's adapter parameters
    # Its adapter and gradients while another tenant is in the model (None while it is in).
    weights: dict[str, torch.Tensor] | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    steps: int = 0

    @property
    def lora(self) -> LoRAConfig:
        return LoRAConfig(rank=self.rank, alpha=self.alpha, targets=sorted(self.modules))


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` (the whole tensor, the same on every rank) laid out as `param` (an FSDP shard)."""
    full = full.to(param.device, param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements)
    return full


class Tenants:
    def __init__(self, model: torch.nn.Module, peft: PeftNames, build_optimizer: Callable[[], Any]):
        self.model, self.peft, self.build_optimizer = model, peft, build_optimizer
        self.linears = dict(lora_modules(model))  # fqn -> LoRA linear
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.max_rank = next(iter(self.linears.values())).lora_a.weight.shape[0]
        self.tenants: dict[str, Tenant] = {}
        self.active: str | None = None

    def _hf_name(self, fqn: str) -> str:
        return self.peft.modules[fqn][0].rsplit(".", 1)[-1]

    def add(self, name: str, rank: int, alpha: float, modules: set[str], seed: int) -> None:
        """A new tenant: fresh adapters of `rank` on `modules` (A as PEFT draws it, from `seed`;
        B = 0: its model is the base model), an optimizer of its own."""
        if name in self.tenants:
            raise ValueError(f"trainer: tenant {name!r} exists")
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"lora rank {rank} is outside [1, {self.max_rank}] (the server's tinker.max_lora_rank)")
        reshard(self.model)
        g = torch.Generator().manual_seed(seed)
        weights = {}
        for fqn in sorted(self.linears):
            linear = self.linears[fqn]
            a = torch.zeros(linear.lora_a.weight.shape)
            if self._hf_name(fqn) in modules:
                torch.nn.init.kaiming_uniform_(a[:rank], a=math.sqrt(5), generator=g)
            weights[f"{fqn}.lora_a.weight"] = _like(a, linear.lora_a.weight)
            weights[f"{fqn}.lora_b.weight"] = _like(torch.zeros(linear.lora_b.weight.shape), linear.lora_b.weight)
        self.tenants[name] = Tenant(rank, alpha, set(modules), self.build_optimizer(), weights=weights)

    def remove(self, name: str) -> None:
        self.tenants.pop(name, None)
        if self.active == name:
            self.active = None
            for p in self.params.values():
                p.grad = None

    def get(self, name: str) -> Tenant:
        if name not in self.tenants:
            raise KeyError(f"trainer: no tenant {name!r}")
        return self.tenants[name]

    def activate(self, name: str) -> Tenant:
        """Put `name`'s adapter, gradients and scaling in the model (the one in it is kept aside)."""
        tenant = self.get(name)
        if self.active == name:
            return tenant
        reshard(self.model)
        if self.active is not None:
            held = self.tenants[self.active]
            held.weights = {n: p.detach().clone() for n, p in self.params.items()}
            held.grads = {n: p.grad for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tenant.weights[n])
                p.grad = tenant.grads.get(n)
        for linear in self.linears.values():
            linear._lora_scaling = tenant.alpha / tenant.rank
        tenant.weights, tenant.grads, self.active = None, {}, name
        return tenant

    def adapter(self, name: str) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
        """`name`'s adapter as PEFT tensors of its own rank, its modules only (whole, on the
        CPU; every rank must call this: FSDP gathers), and its config."""
        tenant = self.activate(name)
        out = {}
        for key, t in self.peft.tensors(self.model).items():
            module = key.split(".lora_")[0].rsplit(".", 1)[-1]
            if module in tenant.modules:
                out[key] = t[: tenant.rank].clone() if ".lora_A." in key else t[:, : tenant.rank].clone()
        return out, tenant.lora
