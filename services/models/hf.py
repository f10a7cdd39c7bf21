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

MOE_KEYS = ("num_experts", "moe_num_experts", "num_local_experts", "n_routed_experts")  # vLLM's


def supports(hf: dict) -> bool:
    """Whether transformers has a causal LM for `hf`'s model_type (dense: MoE checkpoints need a
    family of their own, for routing replay and expert parallelism) of the layout the backend
    wraps: its decoder at `.model` (base_model_prefix), whose `.layers` the backend walks. GPT-2's
    `.transformer.h` and GPT-NeoX's `.gpt_neox.layers` fail in the backend's constructor."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf.get("model_type"))
    if name is None or any(hf.get(k) for k in MOE_KEYS):
        return False
    return getattr(getattr(transformers, name, None), "base_model_prefix", None) == "model"


def _refuse_remote_code(hf: dict) -> None:
    """The backend loads the config with trust_remote_code=True: an `auto_map` in config.json
    would run Python from the model directory."""
    if "auto_map" in hf:
        raise ValueError(
            f"{hf['_name_or_path']}/config.json: key 'auto_map' names code in the model directory "
            "(custom modeling code), which forge does not run; remove the key to use transformers' own classes"
        )


def titan_config(hf: dict, device_type: str = "cpu") -> Any:
    """The backend's model config for the checkpoint whose config.json is `hf` (read from its
    directory, `_name_or_path`: the backend loads it with AutoConfig itself)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.experiments.transformers_modeling_backend import HFTransformerModel, TitanModelConfig
    from transformers import PretrainedConfig

    _refuse_remote_code(hf)
    # block_causal: packed episodes attend only within themselves, as forge's own families do.
    cfg = HFTransformerModel.Config(model_config=TitanModelConfig(attn_mask_type="block_causal"))
    runtime = SimpleNamespace(
        hf_model=hf["_name_or_path"],
        training=SimpleNamespace(seq_len=hf.get("max_position_embeddings", 2048)),
        parallelism=ParallelismConfig(),
        debug=SimpleNamespace(deterministic=False),
        loss=SimpleNamespace(),
    )
    # The backend adds the checkpoint's key aliases (GPT-2's n_embd, ...) to `attribute_map` in
    # place, which is PretrainedConfig's class-level dict: every config in the process would take
    # them. This config gets a copy of its own.
    cfg.attribute_map = dict(PretrainedConfig.attribute_map)
    cfg.update_from_config(config=runtime)
    if device_type == "cpu":  # flex attention has no backward on CPU: SDPA, told the mask (attention_masks)
        cfg._attn_implementation = "sdpa"
    return cfg


FLEX_BLOCK = 128  # the backend's flex block size (its get_attention_masks)


def sliding_window(model: Any) -> int | None:
    """The window of `model`'s sliding-window attention layers (transformers' `sliding_window`,
    on the layers `layer_types` says, on all without it), None where none slides. The masks forge
    gives the backend attend whole episodes: an episode longer than this would differ."""
    config = model.model.config
    window = getattr(config, "sliding_window", None)
    if not window or "sliding_attention" not in (getattr(config, "layer_types", None) or ["sliding_attention"]):
        return None
    return window


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
    except AttributeError as e:  # a decoder the backend cannot walk (no `.model.layers`, e.g. OPT's)
        raise ValueError(
            f"{cfg.architectures[0]}: not a layout torchtitan's transformers backend can build ({e})"
        ) from None
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
