"""torchtitan as a library: build a model of its family (services/models/) sized from an HF
config.json, load HF weights through the family's state-dict adapter (the path a real
checkpoint takes), shard it with FSDP2. Every platform specific of the trainer, the reference
and the trainer benchmark lives here or in services/models/layers.py, each with its one-line why.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.nn.attention.flex_attention import and_masks
from torchtitan.models.common.attention import FlexAttention, create_attention_mask, get_causal_mask_mod

from forge.losses.logprobs import chunkable, head_logprobs
from forge.schema import LoRAConfig
from forge.types import MEMBERS, sees
from services import models
from services.lora import adapt, add_dropout, is_adapter
from services.models import hf
from services.models.layers import route_as


def packed_causal_mask(positions: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, 1, seq, seq]: token q sees token k <= q of its own episode (a new one starts
    where `positions` is 0, torchtitan's packed-document convention), or with `segments`
    (Batch.segments) of what its segment sees: itself and its unit's shared prompt."""
    segments = _segments(positions, segments)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return (causal & sees(segments[:, :, None], segments[:, None, :]))[:, None]


def _segments(positions: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """Batch.segments, or for packed episodes laid out whole, one unit per episode."""
    return segments if segments is not None else torch.cumsum(positions == 0, dim=1) * MEMBERS


def _flex_mask(positions: torch.Tensor, segments: torch.Tensor, block_size: int) -> Any:
    """flex attention's BlockMask for `segments`, through torchtitan's compiled builder: the
    mask rule as `packed_causal_mask`'s, for flex (torchtitan's own masks know documents, not
    shared prompts)."""

    def shared_prompt(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return sees(segments[b, q], segments[b, kv])

    rows, seq = positions.shape
    mask_mod = and_masks(get_causal_mask_mod(), shared_prompt)
    return create_attention_mask(mask_mod, rows, None, seq, seq, device=positions.device, BLOCK_SIZE=block_size)


# Tokens whose logits are alive at once in token_logprobs (forward and backward): 2048 x Qwen3's
# 151,936-token vocabulary is 1.2 GB of fp32 logits, whatever the batch.
LOGPROB_CHUNK = 2048
INDEX = "model.safetensors.index.json"  # a sharded checkpoint's: which file holds each weight
SCORE_HEAD = "score.weight"  # HF's *ForSequenceClassification head: Linear(hidden, num_labels, bias=False)


def load_hf_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    parallelism: Any = None,
    lora: LoRAConfig | None = None,
    head: str = "lm",
) -> torch.nn.Module:
    """The torchtitan model of `model_dir`'s family with its HF safetensors weights, fp32; with a
    torchtitan ParallelismConfig, its modules carry the sharding that config asks for (EP), for
    their family's parallelize to apply. With `lora` enabled, the target linears carry fresh
    adapters (B = 0: the model's outputs are the checkpoint's) and only they train. With `head`
    "score", one scalar per token instead of logits (a reward model's or a critic's): the
    checkpoint's `score.weight` (a sequence-classification checkpoint), else a fresh one."""
    device = torch.device(device)
    hf = models.hf_config(model_dir)
    family = models.of(hf)
    cfg = family.titan_config(hf, device.type)
    if lora is not None and lora.enabled:
        cfg = adapt(cfg, family, lora)
    if parallelism is not None:
        cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = family.build(cfg)
    model.to_empty(device=device)
    # Every rank draws the same fresh adapters (FSDP keeps each rank's shard of its own copy),
    # and so does every run: a seeded RNG, the caller's left as it was.
    cpu = device.type == "cpu"
    with torch.no_grad(), torch.random.fork_rng(devices=[] if cpu else [device], device_type=device.type):
        torch.manual_seed(0)
        # init_weights re-ties the embeddings (to_empty unties them) and fills the RoPE cache.
        model.init_weights(buffer_device=device)
    hf_state = {}
    for f in weight_files(Path(model_dir)):
        try:
            hf_state.update(load_file(str(f), device=str(device)))
        except SafetensorError as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    score = hf_state.pop(SCORE_HEAD, None)
    _untie_check(hf, hf_state, model_dir)
    try:
        titan_state = family.adapter(cfg).from_hf(hf_state)
    except KeyError as e:  # the adapter's name map has no entry for a weight (e.g. attention biases)
        name = _weight_named(hf_state, e.args[0])
        raise ValueError(f"{model_dir}: weight {name!r} is not one the {family.name} family has") from None
    _sizes_check(model, titan_state, model_dir)
    missing, unexpected = model.load_state_dict(titan_state, strict=False)
    # adapters keep their init; a sequence-classification checkpoint has no LM head
    missing = [k for k in missing if not is_adapter(k) and not (score is not None and k.startswith("lm_head."))]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    if head == "score":
        score_head(model, score)
    elif score is not None:
        raise ValueError(f"{model_dir} is a sequence-classification checkpoint (score.weight): it has no LM head")
    if lora is not None:
        add_dropout(model, lora.dropout)
    return model.float()


def _weight_named(hf_state: dict[str, torch.Tensor], key: Any) -> Any:
    """The checkpoint's weight a state-dict adapter's `key` stands for: its name map keys a
    layer's weights by template ("model.layers.{}.self_attn.k_proj.bias")."""
    return next((k for k in hf_state if re.sub(r"\.\d+\.", ".{}.", k, count=1) == key), key)


def _sizes_check(model: torch.nn.Module, titan_state: dict[str, torch.Tensor], model_dir: str | Path) -> None:
    """The checkpoint's weights have the sizes its config.json gives the model, else an error naming them."""
    expected = model.state_dict()
    wrong = [
        f"{k} {tuple(v.shape)}, not {tuple(expected[k].shape)}"
        for k, v in titan_state.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if wrong:
        raise ValueError(f"{model_dir}: weights of other sizes than config.json gives: {wrong[:3]}")


def _untie_check(hf: dict[str, Any], hf_state: dict[str, torch.Tensor], model_dir: str | Path) -> None:
    """A tied checkpoint's head is its embeddings: a stored lm_head.weight beside them (some
    exporters write both) would be loaded after them into the one shared tensor. Dropped where it
    is the same tensor; where it differs the checkpoint is not tied, whatever config.json says."""
    head, embed = hf_state.get("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
    if not hf.get("tie_word_embeddings", False) or head is None or embed is None:
        return
    if not torch.equal(head, embed):
        raise ValueError(
            f"{model_dir}: config.json says tie_word_embeddings, but its lm_head.weight differs from "
            "model.embed_tokens.weight (set tie_word_embeddings to false to load the separate head)"
        )
    del hf_state["lm_head.weight"]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of `model_dir`'s HF weights: the ones its index's weight_map lists, as
    transformers and vLLM load them (a hub snapshot may hold others beside them, e.g. Mistral's
    consolidated.safetensors, the same weights under other names), else every *.safetensors."""
    index = model_dir / INDEX
    if not index.is_file():
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
        return files
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (JSON with a 'weight_map' of key -> file): {e!r}") from None
    files = [_inside(model_dir, name, index) for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{index}: its weight_map lists {missing}, not in {model_dir}")
    return files


def _inside(model_dir: Path, name: Any, index: Path) -> Path:
    """The file `name` of `index`'s weight_map: a relative path within `model_dir` (transformers
    and vLLM join the two), not one that reads weights from elsewhere. Not resolved: a hub
    snapshot's files are links into its blob store."""
    parts = Path(name).parts if isinstance(name, str) else ()
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"{index}: weight_map entry {name!r} is not a file inside {model_dir}")
    return model_dir / name


def score_head(model: torch.nn.Module, weight: torch.Tensor | None) -> None:
    """`model`'s LM head replaced by one scalar per token, `weight` ([1, hidden]) or a fresh
    one (N(0, 1 / hidden): a score of order 1 from the start). The embeddings keep the weights
    a tied head shared with them."""
    hidden = model.lm_head.in_features
    if weight is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            weight = torch.randn(1, hidden) / hidden**0.5
    if tuple(weight.shape) != (1, hidden):
        raise ValueError(f"score.weight is {tuple(weight.shape)}, not (1, {hidden}): one score per sequence")
    head = torch.nn.Linear(hidden, 1, bias=False, device=model.lm_head.weight.device)
    with torch.no_grad():
        head.weight.copy_(weight)
    model.lm_head = head
    model.enable_weight_tying = False


def token_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """A score-head model's scalar at every token, [rows, seq] (a sequence's score: its last token's)."""
    return _forward(model, input_ids, positions, segments)[..., 0].float()


def token_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """A critic's value of each token's state, token-aligned as `token_logprobs`: index t is the
    score-head output at t - 1 (the tokens before t), 0 at t = 0; [rows, seq]."""
    return torch.nn.functional.pad(token_scores(model, input_ids, positions, segments)[:, :-1], (1, 0))


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


def build_sharded_model(
    model_dir: str | Path,
    device: torch.device,
    param_dtype: str = "float32",
    expert_parallel: int = 1,
    lora: LoRAConfig | None = None,
    head: str = "lm",
) -> torch.nn.Module:
    """The HF model of `model_dir` in torchtitan, FSDP2-sharded (its family's parallelize) over
    every rank of the default process group (`init_distributed` first), in training mode; a MoE's
    experts split over `expert_parallel` of those ranks (torchtitan's EP: all-to-all dispatch)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    world = dist.get_world_size()
    family = models.of_model(model_dir)
    backend = "partial_dtensor"  # torchtitan's default SPMD backend fails with more than one rank here
    dist_utils.set_spmd_backend(backend)
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=world,
        cp=1,
        tp=1,
        pp=1,
        ep=expert_parallel,
        world_size=world,
        spmd_backend=backend,
    )
    dims.build_mesh()
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world, expert_parallel_degree=expert_parallel, spmd_backend=backend
    )
    model = family.parallelize(
        load_hf_model(model_dir, device, parallelism if expert_parallel > 1 else None, lora, head),
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="/tmp",
    )
    # Every family sums its ranks' gradients (torchtitan's families already do): each rank's loss
    # counts by its share of the step's tokens, over all ranks.
    disable_fsdp_gradient_division(model)
    if dist.get_backend() == "gloo":  # FSDP sums with PREMUL_SUM, which gloo lacks
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return model.train()


def reshard(model: torch.nn.Module) -> None:
    """A forward without backward (logprobs) leaves FSDP's root group unsharded: what is written
    into the parameters (a checkpoint, another adapter) must land in the sharded ones, which the
    next forward gathers again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    attention = getattr(getattr(model, "config", None), "first_attention", None)
    _check_context(model, attention, ids, positions)
    if positions is None and attention is not None and not isinstance(attention.inner_attention, FlexAttention.Config):
        return model(ids)  # one episode per row: SDPA's own causal kernel
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(ids, positions=positions, attention_masks=_attention_masks(model, attention, positions, segments))


def _check_context(model: torch.nn.Module, attention: Any, ids: torch.Tensor, positions: torch.Tensor | None) -> None:
    """An episode longer than the model's context is an error naming the limit: forge's families
    have RoPE tables of max_position_embeddings rows (past them, a shape error deep in attention),
    the hf family's masks ignore a sliding window (past it, other logprobs than transformers')."""
    if attention is None:
        limit, key = hf.sliding_window(model), "sliding_window"
    else:
        limit, key = getattr(getattr(attention, "rope", None), "max_seq_len", None), "max_position_embeddings"
    # A token's position is at most its index: only a row longer than the limit needs the (syncing) max.
    if limit is None or ids.shape[1] <= limit:
        return
    longest = ids.shape[1] if positions is None else int(positions.max()) + 1
    if longest > limit:
        raise ValueError(f"a {longest}-token sequence is longer than the model's {key} ({limit}, config.json)")


def _attention_masks(
    model: torch.nn.Module, attention: Any, positions: torch.Tensor, segments: torch.Tensor | None
) -> Any:
    """What `model` attends by: causal within each packed episode, or with `segments` within what
    each segment sees; flex's block mask, or a dense one for SDPA."""
    if attention is None:  # the hf family: transformers' attention, given its mask
        if segments is None:
            return hf.attention_masks(model, positions)
        if hf.uses_sdpa(model):  # the backend's dense masks are additive, in the model's dtype
            allowed = packed_causal_mask(positions, segments)
            zeros = torch.zeros(allowed.shape, dtype=model.tok_embeddings.weight.dtype, device=allowed.device)
            return zeros.masked_fill(~allowed, float("-inf"))
        return _flex_mask(positions, segments, hf.FLEX_BLOCK)
    if isinstance(attention.inner_attention, FlexAttention.Config):
        if segments is None:  # torchtitan's own packed-document block mask
            return model.get_attention_masks(positions)
        return _flex_mask(positions, segments, attention.inner_attention.block_size)
    return packed_causal_mask(positions, segments)


@contextmanager
def _hidden_states(model: torch.nn.Module) -> Iterator[None]:
    """The model's forward returns its last hidden states (after the final norm), not logits:
    the head runs in head_logprobs, a chunk of tokens at a time. torchtitan's decoders (and its
    transformers backend) skip their head on this flag, as its ChunkedLossWrapper has them."""
    model._skip_lm_head = True
    try:
        yield
    finally:
        model._skip_lm_head = False


def target_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = LOGPROB_CHUNK
) -> torch.Tensor:
    """log p(targets[:, t] | input_ids[:, :t + 1]) for every t, [rows, seq]: Tinker's alignment,
    where a datum names the token each position predicts (usually the next input)."""
    return _logprobs(model, input_ids, None, targets, chunk_tokens, False)[0]


def _logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    segments: torch.Tensor | None = None,
    temperatures: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, len(targets)] logprobs of `targets`, the model's outputs at positions 0.. predicting
    them (at each target's sampling temperature, where given): from its last hidden states and
    its head in chunks (forge.losses.logprobs), or, for a head the chunks cannot stand in for
    (adapters, hooks), from the model's own logits."""
    n = targets.shape[1]
    if chunk_tokens > 0 and chunkable(model.lm_head):
        with _hidden_states(model):
            hidden = _forward(model, ids, positions, segments)[:, :n]
        return head_logprobs(model.lm_head, hidden, targets, chunk_tokens, with_entropy, temperatures)
    logits = _forward(model, ids, positions, segments)[:, :n]
    return head_logprobs(torch.nn.Identity(), logits, targets, 0, with_entropy, temperatures)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    chunk_rows: int = 0,
    with_entropy: bool = False,
    positions: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
    chunk_tokens: int = LOGPROB_CHUNK,
    segments: torch.Tensor | None = None,
    temperatures: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t | tokens < t) for every t, token-aligned ([rows, seq], 0 at t=0), and
    optionally the entropy of each of those next-token distributions (no grad). On packed rows
    (`positions`, see `collate`) each episode sees only itself; with `segments` (a group's prompt
    shared), each segment what Batch.segments says, and a segment's first token gets 0 (its
    logprob is its episode's, where its prompt is: loss tokens come after). A MoE replays `routed_experts`
    (the generator's routing, Batch.routed_experts) where given. With `temperatures`
    (Batch.temperatures, token-aligned), token t's distribution is at its sampling temperature.

    The head and its log-softmax run `chunk_tokens` tokens at a time, forward and backward
    (forge.losses.logprobs; 0: all at once); `chunk_rows` bounds the rows in one forward
    (the reference model, under no_grad)."""
    rows = input_ids.shape[0]
    step = chunk_rows or rows
    lps, ents = [], []
    for start in range(0, rows, step):
        ids = input_ids[start : start + step]
        pos = positions[start : start + step] if positions is not None else None
        seg = segments[start : start + step] if segments is not None else None
        temps = temperatures[start : start + step, 1:] if temperatures is not None else None
        route_as(model, routed_experts[start : start + step] if routed_experts is not None else None)
        lp, ent = _logprobs(model, ids, pos, ids[:, 1:], chunk_tokens, with_entropy, seg, temps)
        # An episode's first token has no logprob, packed or not (its "context" is another episode).
        lps.append(_first_zero(lp, pos, seg))
        if with_entropy:
            ents.append(_first_zero(ent, pos, seg))
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _first_zero(
    values: torch.Tensor, positions: torch.Tensor | None, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """[rows, seq - 1] next-token values token-aligned: 0 at t = 0 and at each packed episode's
    (or segment's) start."""
    values = torch.nn.functional.pad(values, (1, 0))
    if positions is None:
        return values
    starts = positions == 0
    if segments is not None:
        starts[:, 1:] |= segments[:, 1:] != segments[:, :-1]
    return values.masked_fill(starts, 0.0)
