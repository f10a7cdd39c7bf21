"""Qwen3 (dense): torchtitan's Qwen3 sized from an HF config.json, its state-dict adapter and
parallelize function, the `<|im_end|>` that ends a chat turn, and a tiny HF Qwen3 for tests.

torchtitan's own registry knows only fixed flavors ("0.6B", ...), so the config is built from
the HF values with torchtitan's config helpers. torchtitan is imported where a model is built:
importing it costs ~2 s, which processes that only read configs do not pay.
"""

from __future__ import annotations

from typing import Any

END_OF_TURN = "<|im_end|>"


def titan_config(hf: dict, device_type: str = "cpu") -> Any:
    """torchtitan's Qwen3Model.Config for the HF config `hf` (attention for `device_type`)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock

    from services.models.layers import INIT, attention_config, rms_norm, rope_theta

    dim, vocab, eps = hf["hidden_size"], hf["vocab_size"], hf["rms_norm_eps"]
    head_dim = hf.get("head_dim") or dim // hf["num_attention_heads"]
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=rope_theta(hf))
    layer = Qwen3TransformerBlock.Config(
        attention_norm=rms_norm(dim, eps),
        ffn_norm=rms_norm(dim, eps),
        attention=make_gqa_config(
            dim=dim,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"],
            head_dim=head_dim,
            wqkv_param_init=INIT,
            wo_param_init=INIT,
            inner_attention=attention_config(device_type),
            rope=rope,
            qk_norm=rms_norm(head_dim, eps),
        ),
        feed_forward=make_ffn_config(
            dim=dim, hidden_dim=hf["intermediate_size"], w1_param_init=INIT, w2w3_param_init=INIT
        ),
    )
    return Qwen3Model.Config(
        dim=dim,
        vocab_size=vocab,
        norm=rms_norm(dim, eps),
        layers=[layer] * hf["num_hidden_layers"],
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
    """A Qwen3ForCausalLM of `spec`'s sizes (a TinyModelSpec) for `tokenizer`, initialized from `spec.seed`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {spec.vocab_size}")
    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    # A chat turn ends at <|im_end|> as well as at EOS (Qwen3's generation config does the same).
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    return model
