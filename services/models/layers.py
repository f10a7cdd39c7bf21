"""torchtitan building blocks every family's model config uses, with their platform specifics."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_gqa_config
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.nn_modules import RMSNorm

# Init for the projections when a model is trained from scratch; HF weights overwrite it.
INIT = {"weight": partial(torch.nn.init.normal_, std=0.02)}


class PackedSDPA(ScaledDotProductAttention):
    """torchtitan's SDPA, which also takes a dense boolean mask [rows, 1, seq, seq]: packed rows
    on CPU, where torchtitan's FlexAttention (its packed-document attention) has no backward."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, **kwargs)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def attention_config(device_type: str) -> FlexAttention.Config | PackedSDPA.Config:
    # torchtitan's FlexAttention has no backward on CPU; SDPA is the same attention there.
    return PackedSDPA.Config() if device_type == "cpu" else FlexAttention.Config()


def gqa_config(hf: dict, device_type: str, rope: Any, **extra: Any) -> Any:
    """torchtitan's grouped-query attention sized from the HF config `hf` (`extra`: a family's
    own keys, e.g. Qwen3's head_dim and qk_norm)."""
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    return make_gqa_config(
        dim=hf["hidden_size"],
        n_heads=heads,
        n_kv_heads=kv_heads,
        wqkv_param_init=INIT,
        wo_param_init=INIT,
        inner_attention=attention_config(device_type),
        rope=rope,
        **extra,
    )


def rms_norm(n: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=n, eps=eps)


def rope_theta(hf: dict) -> float:
    # transformers 5 keeps rope_theta under rope_parameters; older files have it top-level. Neither:
    # transformers' default for Llama, Qwen3 and Qwen3-MoE alike.
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))


def rope_scaling(hf: dict) -> tuple[dict, str]:
    """The HF config's rope parameters and their rope_type ("default": no scaling)."""
    # transformers 5 writes `rope_parameters`; checkpoints saved before it `rope_scaling`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return rope, rope.get("rope_type", rope.get("type", "default"))


def check_dense_decoder(hf: dict, family: str, biases: tuple[str, ...]) -> None:
    """The config.json keys transformers reads for `family` that forge's blocks have no place for,
    an error naming them: another activation than SiLU's gated MLP, the biases `biases` (torchtitan's
    projections have none), a sliding window (its attention sees the whole episode)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported for {family} (supported: silu)")
    bias = [key for key in biases if hf.get(key)]
    if bias:
        raise ValueError(
            f"config.json: {' / '.join(bias)} is not supported for {family} (its projections have no bias)"
        )
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") and window and window < hf["max_position_embeddings"]:
        raise ValueError(
            f"config.json: use_sliding_window (sliding_window {window}) is not supported for {family}: "
            "its attention sees the whole sequence"
        )


class ParamDtypeGroupedExperts(GroupedExperts):
    """torchtitan's grouped experts computed in their parameters' dtype: torchtitan's own cast
    every expert matmul to bf16, so an fp32 trainer would not match an fp32 generator (6e-4
    apart on the tiny MoE). Under bf16 mixed precision the parameters, and so the matmuls, are bf16."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.to(w1.dtype)
        h = F.silu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offs).type_as(x_RD)


class ReplayRouter(TokenChoiceTopKRouter):
    """torchtitan's token-choice router that, given a record (`route_as`), takes each token's experts from
    the generator's record instead of its own top-k (tokens without a record, -1, keep its own).
    Like R3 (Ma et al. 2025, "rollout routing replay"), only the choice is replayed: the combine
    weights are this router's own scores at those experts, so the gate still gets a gradient and
    routes as the trainer's weights say wherever the record is silent."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    replay_BLK: torch.Tensor | None = None

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        scores_k, own_k, scores_BLE = super().forward(x_BLD, expert_bias_E)
        if self.replay_BLK is None:
            return scores_k, own_k, scores_BLE
        replay = self.replay_BLK.to(own_k.device)
        ids_BLK = torch.where((replay >= 0).all(-1, keepdim=True), replay, own_k)
        # The parent's scores, gathered at the replayed experts (softmax or sigmoid; its bias
        # picks experts only), then normalised and scaled as it does.
        topk_BLK = scores_BLE.gather(dim=-1, index=ids_BLK)
        if self.route_norm:
            topk_BLK = topk_BLK / (topk_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_BLK * self.route_scale, ids_BLK, scores_BLE


def route_as(model: torch.nn.Module, routed_experts: torch.Tensor | None) -> None:
    """Every ReplayRouter of decoder layer i routes the rows `model` is called on next as
    `routed_experts[:, :, i]` ([rows, seq, layers, top_k]) says; None: each routes itself. It
    stays set until the next call, so a backward that recomputes the forward routes alike."""
    for name, m in model.named_modules():
        if isinstance(m, ReplayRouter):
            layer = int(name.split("layers.")[1].split(".")[0])
            m.replay_BLK = None if routed_experts is None else routed_experts[:, :, layer].long()
