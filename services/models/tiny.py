"""What every family's tiny model (services/tiny_model.py) shares: its HF config's sizes and
special tokens."""

from __future__ import annotations

from typing import Any

# TinyModelSpec's sizes, named as HF configs name them.
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def hf_config_keys(spec: Any, tokenizer: Any) -> dict[str, Any]:
    """The HF config keys of a tiny model of `spec`'s sizes (a TinyModelSpec) for `tokenizer`."""
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {spec.vocab_size}")
    keys: dict[str, Any] = {name: getattr(spec, name) for name in SIZES}
    keys.update({f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")})
    return keys | {"tie_word_embeddings": True, "torch_dtype": "float32"}
