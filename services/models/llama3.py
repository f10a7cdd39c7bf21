"""Llama 3 (dense; Llama-3.x HF checkpoints): torchtitan's Llama3 sized from an HF config.json,
its state-dict adapter and parallelize function, and a tiny HF Llama for tests.

Llama 3.1+ stretches RoPE beyond its original context ("llama3" rope scaling); torchtitan's
ComplexRoPE computes the same frequencies from the four values config.json gives. torchtitan is
imported where a model is built (see qwen3.py).
"""

from __future__ import annotations

from typing import Any


def rope_config(hf: dict, head_dim: int) -> Any:
    """torchtitan's ComplexRoPE for the HF config's rope: plain, or Llama 3's scaling."""
    from torchtitan.models.common import ComplexRoPE

    from services.models.layers import rope_scaling, rope_theta

    rope, kind = rope_scaling(hf)
    if kind not in ("default", "llama3"):
        raise ValueError(f"config.json: rope_type {kind!r} is not supported for llama (supported: default, llama3)")
    scaling = {}
    if kind == "llama3":
        scaling = dict(
            scaling="llama",
            scaling_factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    return ComplexRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=rope_theta(hf), **scaling)


def titan_config(hf: dict, device_type: str = "cpu") -> Any:
    """torchtitan's Llama3Model.Config for the HF config `hf` (attention for `device_type`)."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    from services.models.layers import INIT, check_dense_decoder, gqa_config, rms_norm

    check_dense_decoder(hf, "llama", ("attention_bias", "mlp_bias"))
    dim, vocab, eps = hf["hidden_size"], hf["vocab_size"], hf["rms_norm_eps"]
    head_dim = hf.get("head_dim") or dim // hf["num_attention_heads"]
    if head_dim * hf["num_attention_heads"] != dim:
        raise ValueError(f"config.json: head_dim {head_dim} x num_attention_heads must be hidden_size {dim} for llama")
    layer = Llama3TransformerBlock.Config(
        attention_norm=rms_norm(dim, eps),
        ffn_norm=rms_norm(dim, eps),
        attention=gqa_config(hf, device_type, rope_config(hf, head_dim)),
        feed_forward=make_ffn_config(
            dim=dim, hidden_dim=hf["intermediate_size"], w1_param_init=INIT, w2w3_param_init=INIT
        ),
    )
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        norm=rms_norm(dim, eps),
        layers=[layer] * hf["num_hidden_layers"],
        enable_weight_tying=hf.get("tie_word_embeddings", False),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
    )


def adapter(cfg: Any) -> Any:
    """torchtitan's converter between HF's Llama weights and its own (`from_hf`, `to_hf`; it
    undoes and redoes HF's rotary permutation of q and k)."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(cfg, hf_assets_path=None)


def parallelize(model: Any, **kwargs: Any) -> Any:
    from torchtitan.models.llama3.parallelize import parallelize_llama

    return parallelize_llama(model, **kwargs)


def tiny_model(spec: Any, tokenizer: Any) -> Any:
    """A LlamaForCausalLM of `spec`'s sizes (a TinyModelSpec) for `tokenizer`, with Llama 3's rope
    scaling (its original context a quarter of the model's, so the scaling changes the
    frequencies a test compares)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.models.tiny import hf_config_keys

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": spec.max_position_embeddings // 4,
    }
    config = LlamaConfig(**hf_config_keys(spec, tokenizer), rope_theta=500000.0, rope_scaling=rope, rms_norm_eps=1e-5)
    return LlamaForCausalLM(config)
