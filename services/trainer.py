"""Trainer service: torchtitan as a library, one mesh of N procs (FSDP2 over all of them).

    trainer = await Trainer.options(procs=2).as_actor(model=path, lr=1e-4, loss={"name": "grpo"})
    metrics = (await trainer.train_step.call(batch))  # every rank takes its share of the rows
    version = await trainer.push_weights.call(1)       # publish to the WeightStore, no waiting

Model from torchtitan's Qwen3 (sized from the HF config.json, HF weights through its
state-dict adapter), torchtitan's qwen3 parallelize (FSDP2), optimizer, LR scheduler and
gradient clipping. Checkpoints are DCP (model, optimizer, scheduler, step, version);
`export_hf` writes safetensors that transformers and vLLM load.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from monarch.actor import endpoint

from forge.actor import ForgeActor
from forge.config import from_options
from forge.losses import LOSSES, LossConfig, importance_weight, k3_kl
from forge.types import Batch

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass
class TrainerConfig:
    model: str = ""  # HF model directory
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_decay: str = "none"  # torchtitan decay_type: none | linear | cosine | sqrt
    total_steps: int = 1000  # for the LR schedule
    max_norm: float = 1.0  # gradient clipping
    grad_accum: int = 1  # microbatches per step on each rank
    loss: LossConfig = field(default_factory=LossConfig)
    weights: str = "policy"  # WeightStore name push_weights publishes to
    transport: str = "shm"
    keep_versions: int = 2  # versions kept in the store (>= the staleness window + 1)
    threads: int = 0  # torch threads per rank (0: the cores divided by the ranks)
    param_dtype: str = "float32"  # FSDP2 compute dtype of parameters (bfloat16 on GPU); grads reduce in fp32

    def validate(self) -> None:
        self.loss.validate()


class Trainer(ForgeActor):
    """Policy trainer. Endpoints (call them on every rank with `.call`): train_step,
    logprobs, push_weights, policy_version, save, load, export_hf."""

    distributed = True  # torch.distributed env is set up on the mesh before spawn

    @classmethod
    def check_args(cls, model: str | Path, **options: Any) -> None:
        from_options(TrainerConfig, "Trainer", model, options)

    def __init__(self, model: str | Path, **options: Any):
        self.cfg = from_options(TrainerConfig, "Trainer", model, options)
        self.step = 0
        self.version = 0
        self.store = None  # the WeightStore push_weights writes to (rank 0)

    @endpoint
    async def setup(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        from services.titan import load_hf_model, qwen3_config, read_hf_config, use_device_type

        accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        self.device = torch.device(accel.type, int(os.environ.get("LOCAL_RANK", 0))) if accel else torch.device("cpu")
        use_device_type(self.device.type)
        dist.init_process_group("gloo" if self.device.type == "cpu" else None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.device.type == "cpu":
            torch.set_num_threads(self.cfg.threads or max(1, (os.cpu_count() or 1) // self.world))
        # "partial_dtensor": the default SPMD backend fails with more than one rank here.
        dist_utils.set_spmd_backend("partial_dtensor")
        dims = ParallelDims(dp_replicate=1, dp_shard=self.world, cp=1, tp=1, pp=1, ep=1, world_size=self.world,
                            spmd_backend="partial_dtensor")
        dims.build_mesh()
        self.hf_config = read_hf_config(self.cfg.model)
        self.adapter_config = qwen3_config(self.hf_config)
        model = load_hf_model(self.cfg.model, self.device)
        self.model = parallelize_qwen3(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param=self.cfg.param_dtype, mixed_precision_reduce="float32"),
            parallelism=ParallelismConfig(data_parallel_shard_degree=self.world, spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(enable=False),
            ac_config=None,
            dump_folder="/tmp",
        )
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                # gloo has no PREMUL_SUM, which FSDP picks for its gradient averaging: sum
                # instead; the loss is divided by the number of ranks (train_step).
                m.set_force_sum_reduction_for_comms(True)
        self.model.train()
        c = self.cfg
        self.optimizers = OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={
                "lr": c.lr, "betas": tuple(c.betas), "eps": 1e-8, "weight_decay": c.weight_decay})],
        ).build(model_parts=[self.model])
        decay = {"none": "linear", "linear": "linear", "cosine": "cosine", "sqrt": "sqrt"}[c.lr_decay]
        self.schedulers = LRSchedulersContainer.Config(
            warmup_steps=c.warmup_steps, decay_type=decay, min_lr_factor=1.0 if c.lr_decay == "none" else 0.0,
        ).build(optimizers=self.optimizers, training_steps=c.total_steps)
        self.loss_fn = LOSSES[c.loss.name]

    def _shard(self, batch: Batch) -> Batch:
        """This rank's rows; the caller sends one whole batch to every rank."""
        rows = batch.input_ids.shape[0]
        if rows % (self.world * self.cfg.grad_accum):
            raise ValueError(f"train_step: {rows} rows do not split over {self.world} ranks x grad_accum {self.cfg.grad_accum}")
        per = rows // self.world
        return _rows(batch, slice(self.rank * per, (self.rank + 1) * per))

    @endpoint
    async def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch`; returns metrics averaged over ranks."""
        from torchtitan.distributed import utils as dist_utils

        from services.titan import token_logprobs

        mine = self._shard(batch).to(self.device)
        # Dr.GRPO's default normalizer is the batch's row length, whatever the micro-batches are cut to.
        loss_cfg = dataclasses.replace(self.cfg.loss, norm_tokens=self.cfg.loss.norm_tokens or mine.input_ids.shape[1])
        self.optimizers.zero_grad()
        sums = torch.zeros(6, dtype=torch.float64)  # loss, kl, entropy, is_ratio, is_capped, tokens
        for mb in _micro_batches(mine, self.cfg.grad_accum):
            lp, ent = token_logprobs(self.model, mb.input_ids, with_entropy=True)
            w = importance_weight(lp, mb.gen_logprobs, self.cfg.loss.is_cap)
            loss = self.loss_fn(lp, mb, w, loss_cfg)
            (loss / (self.world * self.cfg.grad_accum)).backward()
            m = mb.loss_mask
            with torch.no_grad():
                raw = torch.exp(lp - mb.gen_logprobs)
                kl = (k3_kl(lp, mb.ref_logprobs) * m).sum() if mb.ref_logprobs is not None else 0.0
                # loss: the objective itself (its share of the mean over ranks and micro-batches); the rest per token
                sums += torch.tensor([loss.item() / (self.world * self.cfg.grad_accum), float(kl), (ent * m).sum().item(),
                                      (raw * m).sum().item(), ((raw > self.cfg.loss.is_cap).float() * m).sum().item(),
                                      m.sum().item()], dtype=torch.float64)
        grad_norm = dist_utils.clip_grad_norm_(list(self.model.parameters()), max_norm=self.cfg.max_norm, foreach=True)
        self.optimizers.step()
        self.schedulers.step()
        self.step += 1
        dist.all_reduce(sums)
        n = max(sums[5].item(), 1.0)
        return {
            "loss": sums[0].item(), "kl": sums[1].item() / n, "entropy": sums[2].item() / n,
            "is_ratio_mean": sums[3].item() / n, "is_capped_frac": sums[4].item() / n,
            "grad_norm": float(grad_norm), "lr": self.schedulers.schedulers[0].get_last_lr()[0],
            "trained_tokens": sums[5].item(),
        }

    @endpoint
    async def logprobs(self, batch: Batch) -> torch.Tensor:
        """Token-aligned logprobs of `batch` under the current policy (every rank: all rows)."""
        from services.titan import token_logprobs

        with torch.no_grad():
            return token_logprobs(self.model, batch.input_ids.to(self.device))[0].cpu()

    def _full_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model with HF names, on rank 0 (every rank must call this)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        hf = Qwen3StateDictAdapter(self.adapter_config, hf_assets_path=None).to_hf(sd)
        if self.hf_config.get("tie_word_embeddings"):
            hf.pop("lm_head.weight", None)  # HF files of tied models have no lm_head
        return {k: v.contiguous() for k, v in hf.items()}

    @endpoint
    async def push_weights(self, version: int) -> int:
        """Publish the current weights as `version` and return; generators pull it themselves.
        Only rank 0 writes (the gathered full state dict); versions older than
        `keep_versions` are dropped."""
        from forge.store import WeightStore

        sd = self._full_hf_state_dict()
        if self.rank == 0:
            if self.store is None:  # one writer for the run: it reuses its dropped versions' files
                self.store = WeightStore(self.cfg.weights, transport=self.cfg.transport)
            await self.store.publish(version, sd)
            await self.store.drop_older_than(version - self.cfg.keep_versions + 1)
        self.version = version
        return version

    @endpoint
    async def policy_version(self) -> int:
        """The version last published or loaded."""
        return self.version

    @endpoint
    async def export_hf(self, path: str) -> str:
        """A HF model directory (safetensors + config + tokenizer) of the current weights."""
        from safetensors.torch import save_file

        sd = self._full_hf_state_dict()
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
            for name in HF_FILES:
                if (Path(self.cfg.model) / name).exists():
                    shutil.copy(Path(self.cfg.model) / name, out / name)
        dist.barrier()
        return path

    def _state(self) -> dict[str, Any]:
        from torchtitan.components.checkpointer import ModelWrapper

        return {"model": ModelWrapper(self.model), "optimizer": self.optimizers, "lr_scheduler": self.schedulers,
                "train_state": {"step": self.step, "version": self.version}}

    @endpoint
    async def save(self, path: str) -> None:
        """DCP checkpoint: model, optimizer, LR scheduler, step, policy version."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=path)

    @endpoint
    async def load(self, path: str) -> int:
        import torch.distributed.checkpoint as dcp

        if not Path(path).is_dir():
            raise FileNotFoundError(f"no trainer checkpoint at {path}")
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        self.step, self.version = state["train_state"]["step"], state["train_state"]["version"]
        return self.step

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.store is not None:
            try:
                await self.store.clear()  # the published versions' shared memory
            except Exception as e:  # the store may already be gone; its files are tmpfs only
                print(f"forge: trainer could not clear weights {self.cfg.weights!r}: {e}", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _micro_batches(b: Batch, n: int) -> list[Batch]:
    """`n` equal micro-batches of rows of similar length, each cut to its own longest row: a
    batch is padded to its longest episode, and with a long tail of lengths most of a
    micro-batch taken in order would be padding."""
    if n == 1:
        return [b]
    lengths = (b.doc_ids >= 0).sum(dim=1)
    order = torch.argsort(lengths, stable=True)
    per = len(order) // n
    return [_rows(b, idx, width=int(lengths[idx].max())) for idx in order.split(per)]


def _rows(b: Batch, rows: slice | torch.Tensor, width: int | None = None) -> Batch:
    """Rows of a padded batch (one episode per row, as the trainer receives it), optionally
    cut to their first `width` columns."""
    keep = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
    for name in ("input_ids", "loss_mask", "advantages", "gen_logprobs", "ref_logprobs", "position_ids", "doc_ids"):
        if keep[name] is not None:
            keep[name] = keep[name][rows, :width]
    # doc_ids index episodes: renumber so row i holds episode i of the slice.
    n = keep["input_ids"].shape[0]
    keep["doc_ids"] = torch.where(keep["doc_ids"] >= 0, torch.arange(n)[:, None].to(keep["doc_ids"].device), -1)
    keep["policy_versions"] = b.policy_versions[rows]
    return Batch(**keep)
