"""torchtitan as a library: build a model sized from an HF config.json, load HF weights,
shard it with FSDP2. Every platform specific of the trainer, the reference and the trainer
benchmark lives here, each with its one-line why.

torchtitan's registry only knows fixed flavors ("0.6B", ...), so the config is built
from the HF values with torchtitan's own config helpers; weights go through its
state-dict adapter, the same path a real Qwen3 checkpoint takes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

# Init for the projections when a model is trained from scratch; HF weights overwrite it.
_INIT = {"weight": partial(torch.nn.init.normal_, std=0.02)}


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    hf = json.loads(path.read_text())
    if hf.get("model_type") != "qwen3":
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r} is not supported (supported: qwen3)")
    return hf


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


def packed_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[rows, 1, seq, seq]: token q sees token k <= q of its own episode (a new one starts
    where `positions` is 0), torchtitan's packed-document convention."""
    docs = torch.cumsum(positions == 0, dim=1)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def attention_config(device_type: str) -> FlexAttention.Config | PackedSDPA.Config:
    # torchtitan's FlexAttention has no backward on CPU; SDPA is the same attention there.
    return PackedSDPA.Config() if device_type == "cpu" else FlexAttention.Config()


def qwen3_config(hf: dict, device_type: str = "cpu") -> Qwen3Model.Config:
    dim, vocab, eps = hf["hidden_size"], hf["vocab_size"], hf["rms_norm_eps"]
    head_dim = hf.get("head_dim") or dim // hf["num_attention_heads"]
    # transformers 5 keeps rope_theta under rope_parameters; older files have it top-level.
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 1e6))

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=eps)

    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=float(theta))
    layer = Qwen3TransformerBlock.Config(
        attention_norm=norm(dim),
        ffn_norm=norm(dim),
        attention=make_gqa_config(
            dim=dim,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"],
            head_dim=head_dim,
            wqkv_param_init=_INIT,
            wo_param_init=_INIT,
            inner_attention=attention_config(device_type),
            rope=rope,
            qk_norm=norm(head_dim),
        ),
        feed_forward=make_ffn_config(
            dim=dim, hidden_dim=hf["intermediate_size"], w1_param_init=_INIT, w2w3_param_init=_INIT
        ),
    )
    return Qwen3Model.Config(
        dim=dim,
        vocab_size=vocab,
        norm=norm(dim),
        layers=[layer] * hf["num_hidden_layers"],
        enable_weight_tying=hf.get("tie_word_embeddings", False),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
    )


def load_hf_model(model_dir: str | Path, device: str | torch.device = "cpu") -> Qwen3Model:
    """A torchtitan Qwen3 model with the HF safetensors weights of `model_dir`, fp32."""
    device = torch.device(device)
    cfg = qwen3_config(read_hf_config(model_dir), device.type)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        # init_weights re-ties the embeddings (to_empty unties them) and fills the RoPE cache.
        model.init_weights(buffer_device=device)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    hf_state = {}
    for f in files:
        hf_state.update(load_file(str(f), device=str(device)))
    model.load_state_dict(Qwen3StateDictAdapter(cfg, hf_assets_path=None).from_hf(hf_state), strict=True)
    return model.float()


def default_device() -> torch.device:
    """This process's accelerator (its LOCAL_RANK's), else the CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device) -> tuple[int, int]:
    """The default process group for `device` (gloo on CPU); returns (rank, world size)."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    # torchtitan picks its device type at import ("cuda" when no accelerator is found), and
    # fully_shard then fails on a CPU machine; point it at the real one.
    for module in (tools_utils, parallel_dims, dist_utils):
        module.device_type = device.type
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else None)
    return dist.get_rank(), dist.get_world_size()


def build_sharded_model(model_dir: str | Path, device: torch.device, param_dtype: str = "float32") -> torch.nn.Module:
    """The HF model of `model_dir` as a torchtitan Qwen3, FSDP2-sharded over every rank of the
    default process group (`init_distributed` first), in training mode."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    world = dist.get_world_size()
    # "partial_dtensor": the default SPMD backend fails with more than one rank here.
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor"
    )
    dims.build_mesh()
    model = parallelize_qwen3(
        load_hf_model(model_dir, device),
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=world, spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="/tmp",
    )
    if gradients_summed():
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return model.train()


def gradients_summed() -> bool:
    """True where FSDP sums gradients over ranks instead of averaging them (the caller divides
    its loss by the world size): gloo has no PREMUL_SUM, which FSDP's averaging uses."""
    import torch.distributed as dist

    return dist.get_backend() == "gloo"


def _forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(model.config.first_attention.inner_attention, FlexAttention.Config):
        # Flex attends to whatever its block mask allows: causal, within each packed episode.
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return model(ids, positions=positions, attention_masks=model.get_attention_masks(positions))
    if positions is None:
        return model(ids)  # one episode per row: SDPA's own causal kernel
    return model(ids, positions=positions, attention_masks=packed_causal_mask(positions))


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    chunk_rows: int = 0,
    with_entropy: bool = False,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t | tokens < t) for every t, token-aligned ([rows, seq], 0 at t=0), and
    optionally the entropy of each of those next-token distributions (no grad). On packed rows
    (`positions`, see `collate`) each episode sees only itself.

    cross_entropy on the logits avoids a second [rows, seq, vocab] log-softmax tensor;
    `chunk_rows` bounds the logits alive at once (the reference model, under no_grad)."""
    rows = input_ids.shape[0]
    step = chunk_rows or rows
    lps, ents = [], []
    for start in range(0, rows, step):
        ids = input_ids[start : start + step]
        pos = positions[start : start + step] if positions is not None else None
        logits = _forward(model, ids, pos)[:, :-1].float()
        flat = logits.reshape(-1, logits.shape[-1])
        lp = -torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="none").view(ids.shape[0], -1)
        lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
        # An episode's first token has no logprob, packed or not (its "context" is another episode).
        lps.append(lp if pos is None else lp.masked_fill(pos == 0, 0.0))
        if with_entropy:
            with torch.no_grad():
                logp = torch.log_softmax(logits, -1)
                ent = -(logp.exp() * logp).sum(-1)
            ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
            ents.append(ent if pos is None else ent.masked_fill(pos == 0, 0.0))
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
