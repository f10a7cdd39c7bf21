"""What every family's tiny model (services/tiny_model.py) shares: its HF config's sizes and
special tokens."""

from __future__ import annotations

from typing import Any


def hf_config_keys(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """The HF config keys of a tiny model of `spec`'s sizes (a TinyModelSpec) for `tokenizer`."""
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {spec.vocab_size}")
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
