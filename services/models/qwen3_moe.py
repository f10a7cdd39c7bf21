"""Qwen3 MoE (Qwen3-30B-A3B and its kin): Qwen3's blocks with a routed-experts MLP where the
checkpoint has one, torchtitan's Qwen3 adapter (which packs the HF per-expert weights into its
grouped experts and back), and a tiny HF Qwen3-MoE for tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.models import qwen3


def moe_config(hf: dict, layer: int) -> Any:
    """torchtitan's MoE config of `layer`, or None where the checkpoint has a dense MLP there."""
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config

    from services.models.layers import INIT, ParamDtypeGroupedExperts, ReplayRouter

    step = hf.get("decoder_sparse_step", 1)
    if layer in hf.get("mlp_only_layers", []) or step < 1 or (layer + 1) % step:
        return None
    # Qwen's checkpoints say `num_experts`; transformers 5 writes `num_local_experts`.
    dim, experts, top_k = hf["hidden_size"], hf.get("num_experts") or hf["num_local_experts"], hf["num_experts_per_tok"]
    experts_cfg = make_routed_experts_config(
        dim=dim,
        hidden_dim=hf["moe_intermediate_size"],
        num_experts=experts,
        top_k=top_k,
        param_init={"w1_EFD": INIT["weight"], "w2_EDF": INIT["weight"], "w3_EFD": INIT["weight"]},
        comm_backend="standard",
    )
    inner = experts_cfg.inner_experts
    experts_cfg = dataclasses.replace(
        experts_cfg,
        inner_experts=ParamDtypeGroupedExperts.Config(
            dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts, param_init=inner.param_init
        ),
    )
    router = make_router_config(
        dim=dim,
        num_experts=experts,
        gate_param_init=INIT,
        top_k=top_k,
        score_func="softmax",
        route_norm=bool(hf.get("norm_topk_prob", False)),  # transformers' default too
    )
    return make_moe_config(
        num_experts=experts,
        # HF's Qwen3-MoE routes by the gate's softmax alone: torchtitan's load-balancing expert
        # bias would pick other experts than the checkpoint (and vLLM) do.
        load_balance_coeff=None,
        router=ReplayRouter.Config(**{f.name: getattr(router, f.name) for f in dataclasses.fields(router)}),
        routed_experts=experts_cfg,
    )


def titan_config(hf: dict, device_type: str = "cpu") -> Any:
    """torchtitan's Qwen3Model.Config for the HF Qwen3-MoE config `hf`."""
    # Qwen3MoeConfig has no head_dim default: transformers takes hidden_size / num_attention_heads.
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return qwen3.titan_config({**hf, "head_dim": head_dim}, device_type, moe=moe_config)


adapter, parallelize = qwen3.adapter, qwen3.parallelize


def tiny_model(spec: Any, tokenizer: Any) -> Any:
    """A Qwen3MoeForCausalLM of `spec`'s sizes: 4 experts of half the dense MLP's width, 2 per
    token, in every layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from services.models.tiny import hf_config_keys

    config = Qwen3MoeConfig(
        **hf_config_keys(spec, tokenizer),
        moe_intermediate_size=spec.intermediate_size // 2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    return Qwen3MoeForCausalLM(config)
