"""Qwen3 (dense): torchtitan's Qwen3 sized from an HF config.json, its state-dict adapter and
parallelize function, and a tiny HF Qwen3 for tests.

torchtitan's own registry knows only fixed flavors ("0.6B", ...), so the config is built from
the HF values with torchtitan's config helpers. torchtitan is imported where a model is built:
importing it costs ~2 s, which processes that only read configs do not pay.
"""

from __future__ import annotations

from typing import Any

HEAD_DIM = 128  # transformers' Qwen3Config default (not hidden_size / num_attention_heads)


def titan_config(hf: dict, device_type: str = "cpu", moe: Any = None) -> Any:
    """torchtitan's Qwen3Model.Config for the HF config `hf` (attention for `device_type`);
    `moe(hf, layer)`: the MoE config of a layer that has one (qwen3_moe.py), else None."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock

    from services.models.layers import INIT, check_dense_decoder, gqa_config, rms_norm, rope_scaling, rope_theta

    check_dense_decoder(hf, "qwen3", ("attention_bias",))
    _, kind = rope_scaling(hf)
    if kind != "default":  # torchtitan's CosSinRoPE has no scaling HF's Qwen3 computes alike
        raise ValueError(f"config.json: rope_type {kind!r} is not supported for qwen3 (supported: default)")
    dim, vocab, eps = hf["hidden_size"], hf["vocab_size"], hf["rms_norm_eps"]
    head_dim = hf.get("head_dim") or HEAD_DIM
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=rope_theta(hf))
    attention = gqa_config(hf, device_type, rope, head_dim=head_dim, qk_norm=rms_norm(head_dim, eps))

    def layer(i: int) -> Any:
        sparse = moe(hf, i) if moe is not None else None
        dense = (
            None
            if sparse
            else make_ffn_config(dim=dim, hidden_dim=hf["intermediate_size"], w1_param_init=INIT, w2w3_param_init=INIT)
        )
        return Qwen3TransformerBlock.Config(
            attention_norm=rms_norm(dim, eps),
            ffn_norm=rms_norm(dim, eps),
            attention=attention,
            feed_forward=dense,
            moe=sparse,
        )

    return Qwen3Model.Config(
        dim=dim,
        vocab_size=vocab,
        norm=rms_norm(dim, eps),
        layers=[layer(i) for i in range(hf["num_hidden_layers"])],
        enable_weight_tying=hf.get("tie_word_embeddings", False),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
    )


def adapter(cfg: Any) -> Any:
    """torchtitan's converter between HF's Qwen3 weights and its own (`from_hf`, `to_hf`)."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(cfg, hf_assets_path=None)


def parallelize(model: Any, **kwargs: Any) -> Any:
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    return parallelize_qwen3(model, **kwargs)


def tiny_model(spec: Any, tokenizer: Any) -> Any:
    """A Qwen3ForCausalLM of `spec`'s sizes (a TinyModelSpec) for `tokenizer` (torch's RNG as the caller seeded it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.models.tiny import hf_config_keys

    return Qwen3ForCausalLM(Qwen3Config(**hf_config_keys(spec, tokenizer), rope_theta=10000.0, rms_norm_eps=1e-6))
