"""Any other dense Hugging Face causal LM (Qwen2/2.5, Mistral, Gemma, ...): transformers' own
modeling code inside torchtitan, through torchtitan's transformers backend
(`experiments/transformers_modeling_backend`: the HF model wrapped as a torchtitan model, its
packed-document attention masks and a state-dict adapter that only adds a prefix), forge's own
FSDP2 (`parallelize`), and a tiny HF Qwen2 for tests.

torchtitan and transformers are imported where a model is built (see qwen3.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def supports(hf: dict) -> bool:
    """Whether transformers has a causal LM for `hf`'s model_type (dense: MoE checkpoints need a
    family of their own, for routing replay and expert parallelism)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return hf.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not any(hf.get(k) for k in MOE_KEYS)


def titan_config(hf: dict, device_type: str = "cpu") -> Any:
    """The backend's model config for the checkpoint whose config.json is `hf` (read from its
    directory, `_name_or_path`: the backend loads it with AutoConfig itself)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.experiments.transformers_modeling_backend import HFTransformerModel, TitanModelConfig

    # block_causal: packed episodes attend only within themselves, as forge's own families do.
    cfg = HFTransformerModel.Config(model_config=TitanModelConfig(attn_mask_type="block_causal"))
    runtime = SimpleNamespace(
        hf_model=hf["_name_or_path"],
        training=SimpleNamespace(seq_len=hf.get("max_position_embeddings", 2048)),
        parallelism=ParallelismConfig(),
        debug=SimpleNamespace(deterministic=False),
        loss=SimpleNamespace(),
    )
    cfg.update_from_config(config=runtime)
    if device_type == "cpu":  # flex attention has no backward on CPU: SDPA, told the mask (attention_masks)
        cfg._attn_implementation = "sdpa"
    return cfg


FLEX_BLOCK = 128  # the backend's flex block size (its get_attention_masks)


def uses_sdpa(model: Any) -> bool:
    return model.model.config._attn_implementation == "sdpa"


def attention_masks(model: Any, positions: Any) -> Any:
    """What the backend's model attends by for `positions` (packed episodes each see only
    themselves): flex's block mask, or under SDPA the dense additive mask torchtitan's backend
    builds for models flex cannot take."""
    if uses_sdpa(model):
        return model._build_dense_attention_mask(positions)
    return model.get_attention_masks(positions)


def build(cfg: Any) -> Any:
    """The model of `cfg`. torchtitan's backend replaces transformers' weight init for every model
    in the process as it builds one (titan's init scheme, skipping meta tensors); from then on
    transformers' own from_pretrained leaves RoPE tables unset. Put transformers' back after."""
    from transformers import PreTrainedModel

    saved = {name: getattr(PreTrainedModel, name) for name in ("_init_weights", "_initialize_weights")}
    try:
        return cfg.build()
    finally:
        for name, fn in saved.items():
            setattr(PreTrainedModel, name, fn)


def adapter(cfg: Any) -> Any:
    from torchtitan.experiments.transformers_modeling_backend import HFTransformerStateDictAdapter

    return HFTransformerStateDictAdapter(cfg, None)


def parallelize(model: Any, *, parallel_dims: Any, training: Any, **_: Any) -> Any:
    """FSDP2 over the data-parallel ranks: each decoder layer its own group, the rest (embedding,
    norm, head) the root's, so a tied embedding and head stay one parameter. Not the backend's own
    parallelize: it needs torchtitan's spmd_types backend and unties the head (a tied checkpoint
    would then train a head vLLM never reads)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import TORCH_DTYPE_MAP

    mesh = parallel_dims.get_mesh("fsdp")
    policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def tiny_model(spec: Any, tokenizer: Any) -> Any:
    """A Qwen2ForCausalLM of `spec`'s sizes (a TinyModelSpec) for `tokenizer`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.models.tiny import hf_config_keys

    return Qwen2ForCausalLM(Qwen2Config(**hf_config_keys(spec, tokenizer), rope_theta=10000.0, rms_norm_eps=1e-6))
