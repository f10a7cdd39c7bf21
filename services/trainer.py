"""Trainer service: torchtitan as a library, one mesh of N procs (FSDP2 over all of them).

    trainer = await Trainer.options(procs=2).as_service(model_dir, TrainerConfig(lr=1e-4), store)
    version, metrics = await trainer.train_step.route(batch)  # every rank takes its share of the rows
    await trainer.push_weights.route()                         # publish `version` (an app: WeightSync.push)

The trainer owns the policy version: each optimizer step makes the next one, `push_weights`
publishes the current one. The model is torchtitan's of the checkpoint's family (sized from the
HF config.json, HF weights through its state-dict adapter; services/models/, services/titan.py), torchtitan's optimizer, LR
scheduler and gradient clipping. Checkpoints are DCP (model, optimizer, scheduler, step,
version); `export_hf` writes safetensors that transformers and vLLM load. The service is
`stateful`: a replica that dies is restored from the service's restore point (a checkpoint).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from monarch.actor import endpoint
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torchtitan.components.checkpointer import ModelWrapper
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.distributed import utils as dist_utils

from forge.actor import ForgeActor
from forge.config import ConfigError, require_file
from forge.lora import write_adapter
from forge.losses import (
    SCORE_LOSSES,
    get_loss,
    importance_weight,
    k3_kl,
    loss_units,
    mismatch_metrics,
    mismatch_sums,
    preference_metric_sums,
    sequence_scores,
)
from forge.losses.tinker import TINKER_LOSSES, Datums, loss_config
from forge.schema import PREFERENCE_LOSSES, LossConfig
from forge.service import last_line
from forge.store import WeightStore
from forge.tasks import end_of_turn
from forge.types import Batch
from services import models
from services.lora import AdapterState, PeftNames, adapters_off, merged
from services.schema import DECAYS, TrainerConfig
from services.tenants import Tenants
from services.titan import (
    SCORE_HEAD,
    build_sharded_model,
    default_device,
    init_distributed,
    reshard,
    target_logprobs,
    token_logprobs,
    token_scores,
    token_values,
)

log = logging.getLogger("forge")
TENANT_META = "tenant.json"  # a tenant checkpoint's LoRA rank, alpha and modules
PAIR_LOSSES = PREFERENCE_LOSSES | {"bradley_terry"}  # episodes 2k and 2k+1 are pair k
HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def weight_store(cfg: TrainerConfig) -> WeightStore:
    """The WeightStore `push_weights` publishes to, as the config says."""
    return WeightStore(cfg.weights, transport=cfg.transport, serve_on=cfg.serve_weights_on, deltas=cfg.weight_deltas)


def build_optimizers(model: torch.nn.Module, c: TrainerConfig) -> tuple[Any, Any]:
    """torchtitan's AdamW and LR scheduler containers for `model`, from the config."""
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": c.lr, "betas": tuple(c.betas), "eps": 1e-8, "weight_decay": c.weight_decay},
            )
        ],
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=c.warmup_steps,
        decay_type=DECAYS[c.lr_decay],
        min_lr_factor=1.0 if c.lr_decay == "none" else 0.0,
    ).build(optimizers=optimizers, training_steps=c.total_steps or max(1, c.warmup_steps))  # constant LR: any length
    return optimizers, schedulers


class Trainer(ForgeActor):
    """Policy trainer; with a score head (`head: score`), a reward model's (`scores`) or PPO's
    critic (`values`). Endpoints (a service call reaches every rank of the replica): train_step,
    logprobs, push_weights, policy_version, save, load, export_hf; and with LoRA, tenants (a Tinker
    client each: its own adapter, optimizer and gradients; services/tenants.py): add_tenant,
    remove_tenant, forward_backward, optim_step, tenant_adapter, save_tenant, load_tenant."""

    distributed = True  # torch.distributed env is set up on the mesh before spawn
    stateful = True  # weights and optimizer: restored from the restore point, never reset

    @classmethod
    def check_args(cls, model: str | Path, cfg: TrainerConfig, store: WeightStore | None = None) -> None:
        if not isinstance(cfg, TrainerConfig):
            raise TypeError(f"Trainer: cfg must be a TrainerConfig, got {type(cfg).__name__}")
        require_file("model.path", Path(model) / "config.json")
        hf = models.hf_config(model)
        if cfg.expert_parallel > 1 and not (hf.get("num_experts") or hf.get("num_local_experts")):
            raise ConfigError(
                f"config key 'trainer.expert_parallel' is {cfg.expert_parallel}, but {model} has no experts"
            )

    def __init__(self, model: str | Path, cfg: TrainerConfig, store: WeightStore | None = None):
        self.model_dir, self.cfg = str(model), cfg
        # The WeightStore push_weights writes to (rank 0). Made by the caller, so a respawned
        # trainer writes as the same writer (its files, its run directory).
        self.store = store if store is not None else weight_store(cfg)
        self.step = 0
        self.version = 0
        self._dropping: asyncio.Future | None = None  # the last push's removal of older versions

    @endpoint
    async def setup(self) -> None:
        self.device = default_device()
        self.rank, self.world = init_distributed(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(self.cfg.threads or max(1, (os.cpu_count() or 1) // self.world))
        self.hf_config = models.hf_config(self.model_dir)
        family = models.of(self.hf_config)
        self.adapter = family.adapter(family.titan_config(self.hf_config, self.device.type))  # for HF exports
        self.model = build_sharded_model(
            self.model_dir, self.device, self.cfg.param_dtype, self.cfg.expert_parallel, self.cfg.lora, self.cfg.head
        )
        self.peft = PeftNames(self.model, self.adapter) if self.cfg.lora.enabled else None
        self.optimizers, self.schedulers = build_optimizers(self.model, self.cfg)
        self.loss_fn = get_loss(self.cfg.loss.name) if self.cfg.head == "lm" else None
        self.tenants = Tenants(self.model, self.peft, self._tenant_optimizer) if self.peft is not None else None

    def _shard(self, batch: Batch) -> Batch:
        """This rank's rows; the caller sends one whole batch to every rank."""
        rows = batch.input_ids.shape[0]
        if rows % (self.world * self.cfg.grad_accum):
            raise ValueError(
                f"train_step: {rows} rows do not split over {self.world} ranks x grad_accum {self.cfg.grad_accum}"
            )
        # Checked on the whole batch, which every rank sees: a rank whose own rows failed alone
        # would leave the others waiting for it in a collective.
        vocab = self.hf_config.get("vocab_size") or torch.iinfo(torch.long).max
        bad = batch.input_ids[(batch.input_ids < 0) | (batch.input_ids >= vocab)].unique()
        if bad.numel():
            raise ValueError(f"train_step: token ids {bad[:5].tolist()} outside the vocabulary [0, {vocab})")
        per = rows // self.world
        if self.cfg.loss.name in PAIR_LOSSES:
            _pairs_whole(batch)
        return _rows(batch, slice(self.rank * per, (self.rank + 1) * per))

    @endpoint
    async def train_step(self, batch: Batch) -> tuple[int, dict[str, float]]:
        """One optimizer step on `batch`: returns the new policy version and metrics averaged
        over ranks."""
        if self.cfg.head == "score":
            return self._score_step(batch)
        mine = self._shard(batch).to(self.device)
        # Dr.GRPO's default normalizer is the batch's longest episode, whatever the rows and micro-batches.
        loss_cfg = dataclasses.replace(self.cfg.loss, norm_tokens=self.cfg.loss.norm_tokens or batch.longest_episode)
        micro = _micro_batches(mine, self.cfg.grad_accum)
        # Each micro-batch's mean counts by its share of the step's tokens or episodes (all ranks).
        units = torch.stack([loss_units(loss_cfg.name, mb) for mb in micro])
        total = units.sum().reshape(1)
        dist.all_reduce(total)
        shares = units / total.clamp(min=1)
        # The shares sum to 1 over all ranks, whose gradients FSDP sums (services/titan.py).
        self.optimizers.zero_grad()
        # loss, kl, entropy, is_ratio, is_capped, tokens, then the mismatch sums: summed on the
        # device, copied to the host once; the largest |delta logprob| reduces by max.
        sums = torch.zeros(10, dtype=torch.float64, device=self.device)
        peak = torch.zeros(1, dtype=torch.float64, device=self.device)
        own: dict[str, torch.Tensor] = {}  # the loss's own metrics (preference losses: implicit rewards), summed
        for mb, share in zip(micro, shares):
            self._reference_for_free(mb, loss_cfg)
            lp, ent = token_logprobs(
                self.model,
                mb.input_ids,
                with_entropy=True,
                positions=mb.positions,
                routed_experts=mb.routed_experts,
                segments=mb.segments,
                temperatures=mb.temperatures,
            )
            loss = self.loss_fn(lp, mb, importance_weight(lp, mb, loss_cfg), loss_cfg) * share
            loss.backward()
            with torch.no_grad():
                step_sums = self._step_sums(mb, lp, ent, loss)
                sums += step_sums[:-1]
                peak = torch.maximum(peak, step_sums[-1:])
                if loss_cfg.name in PREFERENCE_LOSSES:
                    for key, value in preference_metric_sums(lp, mb, loss_cfg).items():
                        own[key] = own.get(key, 0) + value
        grad_norm = self._optimizer_step()
        dist.all_reduce(sums)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        loss, kl, ent, ratio, capped, tokens, mm_kl, mm_abs, mm_out, fresh, mm_max, norm = torch.cat(
            [sums, peak, torch.as_tensor(grad_norm).reshape(1).to(sums)]
        ).tolist()
        n = max(tokens, 1.0)
        return self.version, {
            "loss": loss,
            "kl": kl / n,
            "entropy": ent / n,
            "is_ratio_mean": ratio / n,
            "is_capped_frac": capped / n,
            "grad_norm": norm,
            "lr": self.schedulers.schedulers[0].get_last_lr()[0],
            "trained_tokens": tokens,
            # Over the tokens sampled on the weights this step starts from (none: 0).
            **{f"mismatch/{k}": v for k, v in mismatch_metrics(mm_kl, mm_abs, mm_out, fresh, mm_max).items()},
            **_means(own, total),
        }

    def _optimizer_step(self) -> torch.Tensor:
        """Clip the gradients, step the optimizer and the LR schedule: the next version. Returns
        the gradients' norm before clipping; a step whose norm is not finite changes no weight."""
        grad_norm = dist_utils.clip_grad_norm_(
            list(self.model.parameters()),
            max_norm=self.cfg.max_norm,
            foreach=True,
            ep_enabled=self.cfg.expert_parallel > 1,  # expert grads live on their own mesh
        )
        _step_if_finite(self.optimizers, grad_norm)
        self.schedulers.step()
        self.step += 1
        self.version += 1
        return grad_norm

    def _score_step(self, batch: Batch) -> tuple[int, dict[str, float]]:
        """A score head's step: a reward model's (the Bradley-Terry loss on the batch's pairs) or
        a critic's (the value loss on the batch's returns)."""
        mine = self._shard(batch).to(self.device)
        micro = _micro_batches(mine, self.cfg.grad_accum)
        units = torch.stack([loss_units(self.cfg.loss.name, mb) for mb in micro])
        total = units.sum().reshape(1)
        dist.all_reduce(total)
        loss_fn, metric_sums = SCORE_LOSSES[self.cfg.loss.name]
        self.optimizers.zero_grad()
        sums: dict[str, torch.Tensor] = {}
        for mb, n in zip(micro, units):
            outputs = self._head_outputs(mb)
            loss = loss_fn(outputs, mb, self.cfg.loss)
            (loss * n / total.clamp(min=1)).backward()
            for key, value in {"loss": loss.detach() * n, **metric_sums(outputs, mb, self.cfg.loss)}.items():
                sums[key] = sums.get(key, 0) + value
        grad_norm = self._optimizer_step()
        tokens = mine.loss_mask.sum().double().reshape(1)
        dist.all_reduce(tokens)  # the step's, every rank's share
        return self.version, {
            **_means(sums, total),
            "grad_norm": float(grad_norm),
            "lr": self.schedulers.schedulers[0].get_last_lr()[0],
            "trained_tokens": float(tokens),
        }

    def _head_outputs(self, b: Batch) -> torch.Tensor:
        """A score head's outputs: a critic's values (token-aligned), else a score at every token."""
        read = token_values if self.cfg.loss.name == "value" else token_scores
        return read(self.model, b.input_ids, b.positions, b.segments)

    @endpoint
    async def scores(self, batch: Batch) -> torch.Tensor:
        """A score head's score of each of `batch`'s episodes, [episodes] (every rank: all rows)."""
        with torch.no_grad():
            b = batch.to(self.device)
            return sequence_scores(token_scores(self.model, b.input_ids, b.positions, b.segments), b).cpu()

    @endpoint
    async def values(self, batch: Batch) -> torch.Tensor:
        """A critic's value of every token of `batch`, token-aligned [rows, seq] (every rank: all rows)."""
        with torch.no_grad():
            b = batch.to(self.device)
            return token_values(self.model, b.input_ids, b.positions, b.segments).cpu()

    def _reference_for_free(self, mb: Batch, loss: LossConfig) -> None:
        """With LoRA, the reference logprobs (of the KL term, of a preference loss) are this
        model's with its adapters off (no reference service, no second copy of the model)."""
        wanted = loss.kl_coef or loss.name in PREFERENCE_LOSSES
        if self.peft is None or not wanted or mb.ref_logprobs is not None:
            return
        with torch.no_grad(), adapters_off(self.model):
            mb.ref_logprobs = token_logprobs(
                self.model, mb.input_ids, positions=mb.positions, segments=mb.segments, temperatures=mb.temperatures
            )[0]

    def _step_sums(self, mb: Batch, lp: torch.Tensor, ent: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step's metrics (see train_step), its max |delta| last."""
        m, cap = mb.loss_mask, self.cfg.loss.is_cap
        raw = torch.exp(torch.where(m.bool(), lp - mb.gen_logprobs, 0.0))  # as k3_kl: no inf off the loss tokens
        kl = k3_kl(lp, mb.ref_logprobs, m).sum() if mb.ref_logprobs is not None else lp.new_zeros(())
        # Each token's episode's version; padding (doc -1) gets the -1 appended (a shard may hold none).
        versions = torch.cat([mb.policy_versions, mb.policy_versions.new_full((1,), -1)])[mb.doc_ids]
        fresh = m * (versions == self.version).to(m.dtype)
        own = torch.stack(
            [loss.detach(), kl, (ent * m).sum(), (raw * m).sum(), ((raw > cap).to(m.dtype) * m).sum(), m.sum()]
        )
        return torch.cat([own.double(), mismatch_sums(lp, mb, fresh, cap)])

    @endpoint
    async def logprobs(self, batch: Batch) -> torch.Tensor:
        """Token-aligned logprobs of `batch` under the current policy (every rank: all rows)."""
        with torch.no_grad():
            b = batch.to(self.device)
            return token_logprobs(
                self.model,
                b.input_ids,
                positions=b.positions,
                routed_experts=b.routed_experts,
                segments=b.segments,
                temperatures=b.temperatures,
            )[0].cpu()

    # ---- tenants: several adapters on this model, one at a time (a Tinker client each) ----

    def _tenant_optimizer(self) -> Any:
        return build_optimizers(self.model, self.cfg)[0]

    def _tenants(self) -> Tenants:
        if self.tenants is None:
            raise ValueError("trainer: tenants need LoRA (config key 'trainer.lora.rank' > 0)")
        return self.tenants

    @endpoint
    async def add_tenant(self, name: str, rank: int, alpha: float, modules: set[str], seed: int) -> None:
        """A new adapter of `rank` on `modules` (HF names), seeded, with an optimizer of its own."""
        self._tenants().add(name, rank, alpha, modules, seed)

    @endpoint
    async def remove_tenant(self, name: str) -> None:
        self._tenants().remove(name)

    @endpoint
    async def forward_backward(
        self,
        name: str,
        datums: Datums,
        loss: str,
        config: dict[str, float] | None = None,
        backward: bool = True,
        tokens_per_pass: int = 8192,
    ) -> tuple[list[list[float]], float]:
        """Tenant `name`'s target logprobs of every datum (each its own length) and the summed
        loss; with `backward`, its gradients grow by the loss's (they add up until `optim_step`).
        Each forward holds at most `tokens_per_pass` tokens (rows x the longest): the activations
        of a request, whatever its size, fit in memory; the loss is a sum, so passes add up to it."""
        cfg = loss_config(loss, config)
        self._tenants().activate(name)
        rows = datums.input_ids.shape[0]
        per = -(-rows // self.world)
        mine = _pad_rows(datums.rows(slice(self.rank * per, (self.rank + 1) * per)), per).to(self.device)
        step = max(1, tokens_per_pass // mine.input_ids.shape[1])  # the same on every rank: FSDP's passes match
        lps, total = [], 0.0
        for start in range(0, per, step):
            part = mine.rows(slice(start, start + step))
            with torch.set_grad_enabled(backward):
                lp = target_logprobs(self.model, part.input_ids, part.target_tokens)
                part_loss = TINKER_LOSSES[loss](lp, part, cfg)
                if backward:  # the loss is a sum, and so is FSDP over the ranks
                    part_loss.backward()
            lps += [row[:n] for row, n in zip(lp.detach().cpu().tolist(), part.lengths)]
            total += float(part_loss.detach())
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (lps, total))
        logprobs = [row for part, _ in gathered for row in part][:rows]
        return logprobs, sum(part_loss for _, part_loss in gathered)

    @endpoint
    async def optim_step(self, name: str, adam: dict[str, float]) -> dict[str, float]:
        """One AdamW step of tenant `name` on its gradients so far, with the request's `adam`
        (learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm: 0 for none)."""
        tenant = self._tenants().activate(name)
        for opt in tenant.optimizer.optimizers:
            for group in opt.param_groups:
                group.update(
                    lr=adam["learning_rate"],
                    betas=(adam["beta1"], adam["beta2"]),
                    eps=adam["eps"],
                    weight_decay=adam["weight_decay"],
                )
        params = list(self.tenants.params.values())
        norm = dist_utils.clip_grad_norm_(params, max_norm=adam["grad_clip_norm"] or math.inf, foreach=True)
        tenant.steps += int(_step_if_finite(tenant.optimizer, norm))
        tenant.optimizer.zero_grad()
        return {"grad_norm": float(norm), "steps": tenant.steps}

    @endpoint
    async def tenant_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], Any]:
        """Tenant `name`'s adapter as PEFT tensors of its own rank, and its LoRAConfig (rank 0's answer)."""
        return self._tenants().adapter(name)

    def _tenant_state(self, name: str, optimizer: bool) -> dict[str, Any]:
        tenant = self._tenants().activate(name)
        state: dict[str, Any] = {"model": AdapterState(self.model), "train_state": {"steps": tenant.steps}}
        if optimizer:
            _adam_state_made(tenant.optimizer)
            state["optimizer"] = tenant.optimizer
        return state

    def _dcp(self, what: str, path: str, state: dict[str, Any]) -> None:
        """DCP's save or load of a tenant's `state`; its failure is that request's ValueError.
        DCP raises CheckpointException, a BaseException: out of an endpoint, Monarch takes that
        for a crash of the whole replica, every tenant's adapter with it."""
        try:
            dcp.save(state, checkpoint_id=path) if what == "save" else dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:
            raise ValueError(f"checkpoint {Path(path).name}: cannot {what} it: {last_line(e)}") from None

    @endpoint
    async def save_tenant(self, name: str, path: str) -> None:
        """DCP checkpoint of tenant `name`: its adapter (at the server's largest rank, its unused
        part zeros), optimizer state and step count, and `tenant.json` (rank, alpha, modules)."""
        self._dcp("save", path, self._tenant_state(name, optimizer=True))
        if self.rank == 0:
            tenant = self.tenants.get(name)
            meta = {"rank": tenant.rank, "alpha": tenant.alpha, "modules": sorted(tenant.modules)}
            (Path(path) / TENANT_META).write_text(json.dumps(meta))

    @endpoint
    async def load_tenant(self, name: str, path: str, optimizer: bool) -> None:
        """Load a `save_tenant` checkpoint into tenant `name` (of the same rank and modules): its
        adapter, and its optimizer state and step count too with `optimizer` (else both start over)."""
        tenant = self._tenants().get(name)
        saved = json.loads((Path(path) / TENANT_META).read_text())
        if (saved["rank"], set(saved["modules"])) != (tenant.rank, tenant.modules):
            raise ValueError(
                f"checkpoint {Path(path).name} has LoRA rank {saved['rank']} on {saved['modules']}; this model "
                f"has rank {tenant.rank} on {sorted(tenant.modules)}"
            )
        reshard(self.model)
        if not optimizer:
            tenant.optimizer, tenant.steps = self._tenant_optimizer(), 0
        state = self._tenant_state(name, optimizer)
        self._dcp("load", path, state)
        if optimizer:
            tenant.steps = state["train_state"]["steps"]
        for p in self.tenants.params.values():
            p.grad = None

    def _full_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model with HF names (LoRA adapters merged in), on rank 0 (every rank must call this)."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        if self.peft is not None:
            sd = merged(sd, self.cfg.lora.scaling)
        score = sd.pop("lm_head.weight") if self.cfg.head == "score" else None
        hf = self.adapter.to_hf(sd)
        if score is not None:  # HF's sequence classifier: its `score` head, no LM head
            hf.pop("lm_head.weight", None)
            hf[SCORE_HEAD] = score
        elif self._untied():  # the merged head is no longer the embeddings
            hf["lm_head.weight"] = sd["lm_head.weight"]
        elif self.hf_config.get("tie_word_embeddings"):
            hf.pop("lm_head.weight", None)  # HF files of tied models have no lm_head
        return {k: v.contiguous() for k, v in hf.items()}

    def _untied(self) -> bool:
        """A LoRA adapter on a head tied to the embeddings: merged, the model has a head of its own."""
        tied = self.hf_config.get("tie_word_embeddings", False)
        return tied and self.peft is not None and "lm_head" in self.cfg.lora.targets

    @endpoint
    async def push_weights(self) -> int:
        """Publish the current weights as the current policy version and return it (a WeightSync
        tells the generators, which pull it). Only rank 0 writes (the gathered full state dict); versions older
        than `keep_versions` are dropped."""
        return await self._push()

    def _published(self) -> dict[str, torch.Tensor] | None:
        """What a version is, on rank 0 (every rank must call this): the LoRA adapter in PEFT's
        names, else the whole model; in `publish_dtype` where set."""
        tensors = self._full_hf_state_dict() if self.peft is None else self.peft.tensors(self.model)
        if self.rank != 0:
            return None
        if self.cfg.publish_dtype:
            dtype = getattr(torch, self.cfg.publish_dtype)
            return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        return tensors

    async def _push(self) -> int:
        sd = self._published()
        if self.rank == 0:
            if self._dropping is not None:
                await self._dropping  # the last push's: its error, if any, is this push's
            await self.store.publish(self.version, sd)
            # Older versions go once the caller has its answer: the generators fetch meanwhile.
            self._dropping = asyncio.ensure_future(
                self.store.drop_older_than(self.version - self.cfg.keep_versions + 1)
            )
        return self.version

    @endpoint
    async def weights_layout(self) -> dict | None:
        """What a published version will be (`WeightStore.layout`: its writer, file and size, rank
        0's), for generators on other hosts to make room for before the first one comes (every
        rank must call this)."""
        sd = self._published()
        return self.store.layout(sd) if self.rank == 0 else None

    @endpoint
    async def policy_version(self) -> int:
        """The version of the current weights (the last step's, or the checkpoint's loaded)."""
        return self.version

    @endpoint
    async def export_hf(self, path: str, merged: bool = False) -> str:
        """A HF model directory (safetensors + config + tokenizer) of the current weights; with
        LoRA, a PEFT adapter directory, or the model with the adapter merged in (`merged`). A
        score head's is always merged: a sequence classifier, its head trained whole, which a
        causal-LM adapter has no place for.

        A full model is written as one model.safetensors: a directory that holds other safetensors
        weights (another checkpoint's shards and index, an adapter) is refused, not cleaned, since
        loaders would read those instead and forge did not write them. Its own earlier export
        (model.safetensors) is replaced."""
        if self.peft is not None and not merged and self.cfg.head != "score":
            tensors = self.peft.tensors(self.model)  # as trained, whatever versions are published in
            if self.rank == 0:
                write_adapter(path, tensors, self.cfg.lora, self.model_dir)
            dist.barrier()
            return path
        other = [_other_weights(Path(path)) if self.rank == 0 else []]
        dist.broadcast_object_list(other, src=0)  # every rank fails alike, none waits at the barrier
        if other[0]:
            raise ValueError(
                f"{path}: holds other weights ({', '.join(other[0][:3])}) that loaders would read instead "
                "of the export; export into an empty directory or remove them"
            )
        sd = self._full_hf_state_dict()
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
            for name in HF_FILES:
                if (Path(self.model_dir) / name).exists():
                    shutil.copy(Path(self.model_dir) / name, out / name)
            if self.cfg.head == "score":
                _as_sequence_classifier(out / "config.json")
            if self._untied():
                config = json.loads((out / "config.json").read_text())
                (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
        dist.barrier()
        return path

    def _state(self) -> dict[str, Any]:
        return {
            "model": AdapterState(self.model) if self.peft is not None else ModelWrapper(self.model),
            "optimizer": self.optimizers,
            "lr_scheduler": self.schedulers,
            "train_state": {"step": self.step, "version": self.version},
        }

    @endpoint
    async def save(self, path: str) -> None:
        """DCP checkpoint: model (with LoRA: the adapters alone), optimizer, LR scheduler, step, policy version."""
        dcp.save(self._state(), checkpoint_id=path)

    @endpoint
    async def load(self, path: str) -> int:
        """Load a `save`d checkpoint; returns its step."""
        return self._load(path)

    def _load(self, path: str) -> int:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"no trainer checkpoint at {path}")
        reshard(self.model)
        state = self._state()
        try:  # a checkpoint that does not fit fails in DCP's plan, before any weight changes
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:  # a BaseException: out of the endpoint, the replica's crash
            raise ValueError(
                f"{path}: cannot load it into this trainer (a checkpoint of another model or trainer.lora?): "
                f"{last_line(e)}"
            ) from None
        self.step, self.version = state["train_state"]["step"], state["train_state"]["version"]
        return self.step

    @endpoint
    async def on_respawn(self, restore_point: str | None = None) -> None:
        """A new replica after a crash: load the checkpoint at `restore_point`, then publish it
        as a version newer than any the dead replica published, so generators move to it
        (versions only grow; episodes of the lost versions are judged by max_staleness)."""
        if restore_point is None:
            raise ValueError("Trainer.on_respawn: no checkpoint to restore from")
        self._load(restore_point)
        newest = [await self.store.latest() if self.rank == 0 else None]
        dist.broadcast_object_list(newest, src=0)
        if newest[0] is not None and newest[0] >= self.version:
            self.version = newest[0] + 1
        await self._push()

    async def __cleanup__(self, exc: Exception | None) -> None:
        if getattr(self, "rank", None) == 0:
            try:
                if self._dropping is not None:
                    await self._dropping
                await self.store.clear()  # the published versions' shared memory
            except Exception as e:  # the store may already be gone; its files are tmpfs only
                print(f"forge: trainer could not clear weights {self.store.name!r}: {e}", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _other_weights(out: Path) -> list[str]:
    """The safetensors weights and indexes in `out` besides model.safetensors (the file a full
    export writes): transformers and vLLM prefer an index's shards, and PEFT an adapter, to it."""
    if not out.is_dir():
        return []
    names = {f.name for f in out.glob("*.safetensors")} | {f.name for f in out.glob("*.safetensors.index.json")}
    return sorted(names - {"model.safetensors"})


def _as_sequence_classifier(config: Path) -> None:
    """An exported reward model's config.json: transformers' AutoModelForSequenceClassification
    of the family, one label (the score), and the pad token of `_score_pad`."""
    cfg = json.loads(config.read_text())
    cfg["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification") for a in cfg.get("architectures", [])]
    cfg["num_labels"] = 1
    cfg.pop("id2label", None)
    cfg.pop("label2id", None)
    cfg["pad_token_id"] = _score_pad(config.parent)
    config.write_text(json.dumps(cfg, indent=2))


def _score_pad(model: Path) -> int:
    """The pad token of the exported reward model in `model`, set in its tokenizer files too.
    transformers' sequence classifier scores a row's last token that is not its pad_token_id
    (none: a batch of one only), forge a sequence's last token, an EOS where a text completion
    ends: a pad that is the EOS (Qwen's base models) or none (Llama 3's) would read another
    token than forge trained, or fail on a batch. The tokenizer's own pad if it is neither the
    EOS nor the end of a turn, else another of its special tokens the chat template never writes
    (one named pad first)."""
    # Here, not at the top: transformers adds 2 s to the start of every process that spawns a trainer.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ends = {tok.eos_token, end_of_turn(tok)}
    if tok.pad_token is not None and tok.pad_token not in ends:
        return tok.pad_token_id
    taken = ends | {tok.bos_token, tok.unk_token}
    spare = [t for t in tok.get_added_vocab() if t not in taken and t not in (tok.chat_template or "")]
    if not spare:
        raise ValueError(
            f"{model}: the tokenizer's pad token is {tok.pad_token!r} (its EOS {tok.eos_token!r}) and it has no "
            "other special token to pad with: transformers would score another token than forge"
        )
    pad = min(spare, key=lambda t: ("pad" not in t.lower(), tok.convert_tokens_to_ids(t)))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (model / name).is_file():
            settings = json.loads((model / name).read_text())
            (model / name).write_text(json.dumps({**settings, "pad_token": pad}, indent=2, ensure_ascii=False))
    return tok.convert_tokens_to_ids(pad)


def _pairs_whole(b: Batch) -> None:
    """A pair loss reads episodes 2k and 2k+1 as pair k; an episode with no token in the batch
    is gone once a shard renumbers the episodes it holds (`_rows`), and every pair after it
    would be read as one pair's rejected and the next one's chosen."""
    held = torch.unique(b.doc_ids[b.doc_ids >= 0])
    if held.numel() != b.num_episodes:
        empty = sorted(set(range(b.num_episodes)) - set(held.tolist()))
        raise ValueError(f"train_step: episodes {empty[:8]} of the batch's pairs have no tokens")


def _step_if_finite(optimizers: Any, grad_norm: torch.Tensor) -> bool:
    """Step `optimizers` unless the gradients' norm (every rank's: all agree) is NaN or inf: a
    step on such gradients would make every weight it touches, and Adam's moments, NaN for good."""
    if bool(torch.isfinite(torch.as_tensor(grad_norm))):
        optimizers.step()
        return True
    log.warning("forge: trainer: the gradients' norm is %s; this step changes no weight", float(grad_norm))
    return False


def _means(sums: dict[str, torch.Tensor], units: torch.Tensor) -> dict[str, float]:
    """Sums of every rank's micro-batches, as means over the step's loss units (all ranks')."""
    if not sums:
        return {}
    reduced = torch.stack([v.double() for v in sums.values()])
    dist.all_reduce(reduced)
    return {key: value / max(float(units), 1.0) for key, value in zip(sums, reduced.tolist())}


def _pad_rows(d: Datums, rows: int) -> Datums:
    """`d` with empty rows (mask 0) up to `rows`: every rank runs a forward, even one with no datum."""
    short = rows - d.input_ids.shape[0]
    if short <= 0:
        return d

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((short, *t.shape[1:]))])

    return Datums(pad(d.input_ids), pad(d.target_tokens), pad(d.mask), {k: pad(v) for k, v in d.inputs.items()})


def _micro_batches(b: Batch, n: int) -> list[Batch]:
    """`n` equal micro-batches of rows of similar length, each cut to its own longest row: a
    batch is padded to its longest row, and with a long tail of lengths most of a
    micro-batch taken in order would be padding."""
    if n == 1:
        return [b]
    # Each row's used width: through its last episode token (a shared prompt before them is doc -1).
    lengths = ((b.doc_ids >= 0) * torch.arange(1, b.doc_ids.shape[1] + 1, device=b.doc_ids.device)).amax(dim=1)
    order = torch.argsort(lengths, stable=True)
    per = len(order) // n
    return [_rows(b, idx, width=max(1, int(lengths[idx].max()))) for idx in order.split(per)]


def _rows(b: Batch, rows: slice | torch.Tensor, width: int | None = None) -> Batch:
    """Rows of a padded batch, optionally cut to their first `width` columns, with the
    episodes they hold renumbered 0.. in order (doc_ids, policy_versions)."""
    per_episode = ("policy_versions", "episode_tokens")
    keep = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
    for name, value in keep.items():  # all [rows, seq, ...] but those [episodes]
        if value is not None and name not in per_episode:
            keep[name] = value[rows, :width]
    docs = keep["doc_ids"]
    held, renumbered = torch.unique(docs[docs >= 0], return_inverse=True)
    keep["doc_ids"] = torch.full_like(docs, -1).masked_scatter(docs >= 0, renumbered)
    for name in per_episode:
        if keep[name] is not None:
            keep[name] = keep[name][held.to(keep[name].device)]
    return Batch(**keep)


def _adam_state_made(optimizers: Any) -> None:
    """Every parameter's Adam state, as AdamW makes it before its first step (step 0, zero
    moments), where it has none yet. Else torchtitan's state_dict makes it by taking a step at lr
    0 (a tenant saved before its first step then counts one step more, its first update ~0.74x),
    or, where some gradient is pending, does not make it: a save with no moments, which a load
    then misses."""
    for opt in optimizers.optimizers:
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    moments = ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if group.get("amsgrad") else ()))
                    zeros = {k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in moments}
                    opt.state[p] = {"step": torch.tensor(0.0), **zeros}
