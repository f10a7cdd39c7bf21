"""Trainer on torchtitan: FSDP2 steps, DCP save/load, HF export, push to the WeightStore."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file
from test_losses import with_ref

from forge.schema import LoRAConfig, LossConfig
from forge.store import WeightStore, start_store, stop_store
from forge.types import Batch, Episode, collate
from services.schema import TrainerConfig
from services.trainer import Trainer


def fixed_batch(rows: int = 4, **episode: list) -> Batch:
    g = torch.Generator().manual_seed(0)
    eps = [
        Episode(
            tokens=torch.randint(6, 100, (12,), generator=g).tolist(),
            loss_mask=[0] * 4 + [1] * 8,
            gen_logprobs=[0.0] * 12,
            advantage=1.0,
            **episode,
        )
        for _ in range(rows)
    ]
    return collate(eps, pad_id=0)


def nll(lp: torch.Tensor, batch) -> float:
    return -(lp * batch.loss_mask).sum().item() / batch.loss_mask.sum().item()


def on_policy(batch, lp: torch.Tensor):
    batch.gen_logprobs = lp * batch.loss_mask
    return batch


def test_two_procs_fsdp_train_save_load_export_push(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    async def main():
        procs = await start_store()
        store = WeightStore("t2")
        cfg = TrainerConfig(lr=1e-3, loss=LossConfig(name="reinforce"))
        trainer = await Trainer.options(procs=2).as_service(str(tiny_model_dir), cfg, store)
        try:
            batch = fixed_batch()
            start, other = await trainer.logprobs.call(batch)  # rank 0 and rank 1 of the replica
            assert torch.equal(start, other)  # the sharded model computes the same logprobs on every rank
            for i in range(20):
                batch = on_policy(batch, await trainer.logprobs.route(batch))
                version, m = await trainer.train_step.route(batch)
                assert version == i + 1  # the trainer owns the policy version: one per step
                assert m["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: ratio 1
            trained = await trainer.logprobs.route(batch)

            await trainer.save.route(str(tmp_path / "ckpt"))
            batch = on_policy(batch, trained)
            cont = await trainer.train_step.route(batch)
            assert await trainer.load.route(str(tmp_path / "ckpt")) == 20
            assert await trainer.policy_version.route() == 20
            again = await trainer.train_step.route(batch)

            await trainer.export_hf.route(str(tmp_path / "hf"))
            after = await trainer.logprobs.route(batch)
            assert await trainer.push_weights.route() == 21  # the current version
            published = await store.fetch(21)
        finally:
            await trainer.shutdown()
            await stop_store(procs)
        return batch, start, trained, cont, again, after, published

    batch, start, trained, cont, again, after, published = asyncio.run(main())
    assert nll(trained, batch) < nll(start, batch) - 0.5  # 20 steps fit the fixed batch
    assert cont == again  # same version, grad norm, loss, entropy...: bit-identical after the reload
    exported = load_file(tmp_path / "hf/model.safetensors")
    assert exported.keys() == published.keys() and all(torch.equal(exported[k], published[k]) for k in exported)
    original = load_file(tiny_model_dir / "model.safetensors")
    assert exported.keys() == original.keys() and not torch.equal(
        exported["model.norm.weight"], original["model.norm.weight"]
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(batch.input_ids).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    assert (lp - after[:, 1:]).abs().max().item() < 1e-4


def test_one_proc_grad_accum_bad_batch_and_bf16_versions(tmp_path, tiny_model_dir):
    """grad_accum 2 trains; a batch that does not split is named; `publish_dtype: bfloat16`
    publishes the fp32 weights cast to bf16 (the export stays fp32). An export replaces its own
    earlier one, and refuses a directory holding other weights (a sharded checkpoint's index and
    shards, which loaders would read instead)."""

    async def main():
        procs = await start_store()
        store = WeightStore("bf16")
        cfg = TrainerConfig(lr=1e-3, grad_accum=2, loss=LossConfig(name="dapo"), publish_dtype="bfloat16")
        trainer = await Trainer.options(procs=1).as_service(str(tiny_model_dir), cfg, store)
        try:
            batch = fixed_batch()
            start = await trainer.logprobs.route(batch)
            for _ in range(5):
                batch = on_policy(batch, await trainer.logprobs.route(batch))
                await trainer.train_step.route(batch)
            end = await trainer.logprobs.route(batch)
            with pytest.raises(ValueError, match="3 rows do not split over 1 ranks x grad_accum 2"):
                await trainer.train_step.route(fixed_batch(3))
            await trainer.export_hf.route(str(tmp_path / "hf"))
            await trainer.export_hf.route(str(tmp_path / "hf"))
            stale = tmp_path / "stale"
            stale.mkdir()
            for name in ("model-00001-of-00001.safetensors", "model.safetensors.index.json"):
                (stale / name).write_text("{}")
            with pytest.raises(ValueError, match=f"{stale}: holds other weights \\(model-00001-of-00001.safetensors"):
                await trainer.export_hf.route(str(stale))
            assert not (stale / "model.safetensors").exists()
            published = await store.fetch(await trainer.push_weights.route())
        finally:
            await trainer.shutdown()
            await stop_store(procs)
        return batch, start, end, published

    batch, start, end, published = asyncio.run(main())
    assert nll(end, batch) < nll(start, batch)
    exported = load_file(tmp_path / "hf/model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.float32} and exported.keys() == published.keys()
    assert all(torch.equal(published[k], t.bfloat16()) for k, t in exported.items())


def test_a_token_id_outside_the_vocabulary_fails_the_step_on_every_rank(tiny_model_dir):
    """Only rank 1's rows hold the bad id: rank 0 must not wait for it in a collective."""

    async def main():
        trainer = await Trainer.options(procs=2).as_service(str(tiny_model_dir), TrainerConfig(threads=1))
        try:
            batch = fixed_batch()
            batch.input_ids[-1, -1] = 10**6
            with pytest.raises(ValueError, match=r"token ids \[1000000\] outside the vocabulary"):
                await asyncio.wait_for(trainer.train_step.route(batch), 120)
            return await asyncio.wait_for(trainer.train_step.route(fixed_batch()), 120)
        finally:
            await trainer.shutdown()

    version, _ = asyncio.run(main())
    assert version == 1


def test_bad_config_and_model_are_named(tiny_model_dir):
    async def main():
        with pytest.raises(ValueError, match="unknown loss 'ppo9'"):
            await Trainer.options().as_service(str(tiny_model_dir), TrainerConfig(loss=LossConfig(name="ppo9")))
        with pytest.raises(Exception, match="config key 'model.path': file not found: /nonexistent/config.json"):
            await Trainer.options().as_service("/nonexistent", TrainerConfig())
        with pytest.raises(TypeError, match="cfg must be a TrainerConfig, got dict"):
            await Trainer.options().as_service(str(tiny_model_dir), {"lr": 1.0})

    asyncio.run(main())


def test_a_step_is_the_whole_batch_however_its_rows_are_split(tiny_model_dir):
    """grad_accum sorts rows by length and cuts each micro-batch to its longest row; packing
    puts several episodes in a row; ranks take unequal shares of the tokens. Each micro-batch's
    loss counts by its share of the step's tokens (or episodes), so loss and gradient equal one
    full-width pass on one rank (Dr.GRPO's norm is the batch's longest episode, whatever the rows)."""
    g = torch.Generator().manual_seed(1)
    eps = [
        Episode(
            tokens=torch.randint(6, 100, (n,), generator=g).tolist(),
            loss_mask=[0] * 3 + [1] * (n - 3),
            gen_logprobs=[-4.0] * n,
            advantage=float(i % 3) - 1.0,
        )
        for i, n in enumerate([5, 40, 7, 6, 9, 5, 33, 8])
    ]
    batch = collate(eps, pad_id=0)

    async def step(batch: Batch, loss: str, grad_accum: int = 1, procs: int = 1) -> dict:
        cfg = TrainerConfig(lr=0.0, grad_accum=grad_accum, loss=LossConfig(name=loss, norm_tokens=40))
        trainer = await Trainer.options(procs=procs).as_service(str(tiny_model_dir), cfg)
        try:
            return (await trainer.train_step.route(batch))[1]
        finally:
            await trainer.shutdown()

    packed = collate(eps, pad_id=0, pack_to=40, rows_multiple_of=4)
    assert packed.input_ids.shape[0] == 4
    for loss, whole, split in (
        ("dr_grpo", asyncio.run(step(batch, "dr_grpo")), asyncio.run(step(batch, "dr_grpo", grad_accum=4))),
        ("sft", asyncio.run(step(batch, "sft")), asyncio.run(step(packed, "sft", grad_accum=2, procs=2))),
    ):
        for key in ("loss", "grad_norm", "entropy", "is_ratio_mean", "trained_tokens"):
            assert abs(whole[key] - split[key]) <= 1e-5 * max(1.0, abs(whole[key])), (loss, key, whole[key], split[key])


def test_a_score_step_counts_every_ranks_tokens(tiny_model_dir):
    """A reward model's step on 2 ranks reports the step's trained tokens, not one rank's share."""
    from apps.dpo import pair_batch

    g = torch.Generator().manual_seed(2)

    def pair(n: int) -> tuple:
        ids = torch.randint(6, 100, (n,), generator=g).tolist()
        return (ids, [0] * 2 + [1] * (n - 2)), (ids[:-1], [0] * 2 + [1] * (n - 3))

    batch = pair_batch([pair(n) for n in (6, 9, 7, 12)], 0, 2)

    async def step(procs: int) -> dict:
        cfg = TrainerConfig(lr=0.0, head="score", loss=LossConfig(name="bradley_terry"))
        trainer = await Trainer.options(procs=procs).as_service(str(tiny_model_dir), cfg)
        try:
            return (await trainer.train_step.route(batch))[1]
        finally:
            await trainer.shutdown()

    assert asyncio.run(step(2))["trained_tokens"] == float(batch.loss_mask.sum())


def test_a_step_whose_gradient_is_not_finite_changes_no_weight(tiny_model_dir):
    """A NaN in the loss (here an advantage's) makes every gradient NaN: that step is skipped,
    its grad_norm says so, and the weights and the optimizer's state stay as they were (an
    applied NaN step would make every weight, and every later step, NaN)."""
    bad = fixed_batch()
    bad.advantages[1] = float("nan")

    async def main():
        trainer = await Trainer.options().as_service(str(tiny_model_dir), TrainerConfig(lr=1e-2))
        try:
            batch = on_policy(fixed_batch(), await trainer.logprobs.route(fixed_batch()))
            before = await trainer.logprobs.route(batch)
            bad.gen_logprobs = batch.gen_logprobs
            version, skipped = await trainer.train_step.route(bad)
            kept = await trainer.logprobs.route(batch)
            await trainer.train_step.route(batch)
            return version, skipped, before, kept, await trainer.logprobs.route(batch)
        finally:
            await trainer.shutdown()

    version, skipped, before, kept, after = asyncio.run(main())
    assert version == 1 and not torch.isfinite(torch.tensor(skipped["grad_norm"]))
    assert torch.equal(kept, before)
    assert after.isfinite().all() and not torch.equal(after, before)


def test_flex_attention_path_matches_sdpa(tiny_model_dir, monkeypatch):
    """Off CPU the model uses torchtitan's FlexAttention, which needs its causal block mask
    passed in (without one it attends to every token). Its forward runs on CPU too: the same
    logprobs as the CPU path's SDPA."""
    from services import titan
    from services.models import layers

    ids = torch.randint(6, 100, (4, 20), generator=torch.Generator().manual_seed(0))
    sdpa = titan.load_hf_model(tiny_model_dir)
    cpu_choice = layers.attention_config
    monkeypatch.setattr(layers, "attention_config", lambda device_type: cpu_choice("cuda"))
    flex = titan.load_hf_model(tiny_model_dir)
    assert isinstance(flex.config.first_attention.inner_attention, layers.FlexAttention.Config)
    with torch.no_grad():
        assert (titan.token_logprobs(sdpa, ids)[0] - titan.token_logprobs(flex, ids)[0]).abs().max() < 1e-5


def test_packed_rows_give_the_same_losses_and_gradients_as_one_episode_per_row(tiny_model_dir, monkeypatch):
    """Packed rows (several episodes per row, each attending only to itself, positions from 0
    at each) give every episode the logprobs it has alone in a row: the same loss and gradient
    for every kind of loss; and the same logprobs under torchtitan's FlexAttention (GPU), whose
    forward runs here."""
    from forge.losses import IS_CORRECTIONS, LOSSES, importance_weight
    from services import titan
    from services.models import layers

    g = torch.Generator().manual_seed(2)
    eps = [
        Episode(
            tokens=torch.randint(6, 100, (n,), generator=g).tolist(),
            loss_mask=[0] * 2 + [1] * (n - 2),
            gen_logprobs=(-torch.rand(n, generator=g) * 4).tolist(),
            advantage=float(i % 3) - 1.0,
            policy_version=i,
        )
        for i, n in enumerate([5, 17, 7, 6, 9, 5, 13, 8])
    ]
    refs = [(-torch.rand(len(e.tokens), generator=g) * 4).tolist() for e in eps]
    rows = with_ref(collate(eps, pad_id=0), refs)
    packed = with_ref(collate(eps, pad_id=0, pack_to=24, rows_multiple_of=4), refs)
    assert packed.input_ids.shape == (4, 24) and packed.num_episodes == 8  # 70 tokens in 3 rows (+1 empty), not 8
    model = titan.load_hf_model(tiny_model_dir)

    def episode_logprobs(batch):
        lp = titan.token_logprobs(model, batch.input_ids, positions=batch.positions)[0]
        return [lp[batch.doc_ids == i] for i in range(len(eps))]

    def loss_and_grad(name, batch, correction="token_truncate"):
        model.zero_grad()
        lp = titan.token_logprobs(model, batch.input_ids, positions=batch.positions)[0]
        cfg = LossConfig(name, kl_coef=0.1, norm_tokens=24, is_correction=correction)
        loss = LOSSES[name](lp, batch, importance_weight(lp, batch, cfg), cfg)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    with torch.no_grad():
        for alone, together in zip(episode_logprobs(rows), episode_logprobs(packed)):
            assert torch.allclose(alone, together, atol=1e-5)
    for name in ("sft", "grpo", "gspo", "dapo", "dr_grpo"):  # per-token and per-episode means
        loss, grad = loss_and_grad(name, rows)
        p_loss, p_grad = loss_and_grad(name, packed)
        assert abs(loss - p_loss) < 1e-5, (name, loss, p_loss)
        assert torch.allclose(grad, p_grad, atol=1e-6), (name, (grad - p_grad).abs().max())
    for correction in IS_CORRECTIONS:  # sequence-level weights too follow each packed episode
        loss, grad = loss_and_grad("grpo", rows, correction)
        p_loss, p_grad = loss_and_grad("grpo", packed, correction)
        assert abs(loss - p_loss) < 1e-5 and torch.allclose(grad, p_grad, atol=1e-6), correction

    cpu_choice = layers.attention_config
    monkeypatch.setattr(layers, "attention_config", lambda device_type: cpu_choice("cuda"))
    flex = titan.load_hf_model(tiny_model_dir)
    model = flex
    with torch.no_grad():
        for alone, together in zip(episode_logprobs(rows), episode_logprobs(packed)):
            assert torch.allclose(alone, together, atol=1e-5)


@pytest.mark.slow  # two trainers, of 2 procs and of 1 or 2
@pytest.mark.parametrize(
    "model, sharded, alone, lora",
    [
        ("tiny_moe_dir", (2, 2), (2, 1), 0),  # the MoE's experts over 2 procs (EP 2) vs FSDP alone
        ("tiny_hf_dir", (2, 1), (1, 1), 0),  # the hf family on 2 FSDP ranks vs 1
        ("tiny_llama_dir", (2, 1), (1, 1), 8),  # LoRA adapters on 2 FSDP ranks vs 1
    ],
)
def test_sharded_trainers_take_the_steps_of_one(tmp_path, request, model, sharded, alone, lora):
    """(procs, trainer.expert_parallel): expert parallelism on the tiny MoE (its 4 experts split
    over 2 procs, torchtitan's all-to-all dispatch, on gloo), forge's FSDP2 of the hf family, and
    LoRA adapters sharded with their frozen base, take the steps of the unsharded trainer: the
    same losses and logprobs, an HF (or PEFT) export of the same weights."""
    model_dir = request.getfixturevalue(model)

    async def run(procs: int, ep: int):
        store = await start_store()
        cfg = TrainerConfig(lr=1e-3, expert_parallel=ep, loss=LossConfig(name="reinforce"), lora=LoRAConfig(rank=lora))
        trainer = await Trainer.options(procs=procs).as_service(str(model_dir), cfg, WeightStore(f"p{procs}e{ep}"))
        try:
            batch, losses = fixed_batch(), []
            for _ in range(3):
                batch = on_policy(batch, await trainer.logprobs.route(batch))
                losses.append((await trainer.train_step.route(batch))[1]["loss"])
            await trainer.export_hf.route(str(tmp_path / f"p{procs}e{ep}"))
            return losses, await trainer.logprobs.route(batch)
        finally:
            await trainer.shutdown()
            await stop_store(store)

    (losses, lp), (want_losses, want_lp) = asyncio.run(run(*sharded)), asyncio.run(run(*alone))
    assert losses == pytest.approx(want_losses, abs=1e-5)
    assert (lp - want_lp).abs().max() <= 1e-5
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    got = load_file(tmp_path / f"p{sharded[0]}e{sharded[1]}/{weights}")
    want = load_file(tmp_path / f"p{alone[0]}e{alone[1]}/{weights}")
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-4) for k in want)


def test_every_family_sums_its_ranks_gradients(tiny_hf_dir):
    """Each rank's loss counts by its share of the step's tokens, so a step's gradient is the
    sum over ranks: the hf family (FSDP wrapped by forge, not torchtitan) too, not their mean."""
    g = torch.Generator().manual_seed(2)
    eps = [
        Episode(torch.randint(6, 100, (n,), generator=g).tolist(), [0] * 2 + [1] * (n - 2), [0.0] * n)
        for n in (9, 12, 7, 10)
    ]
    batch = collate(eps, pad_id=0)

    async def grad_norm(procs: int) -> float:
        trainer = await Trainer.options(procs=procs).as_service(
            str(tiny_hf_dir), TrainerConfig(lr=0.0, loss=LossConfig(name="sft"))
        )
        try:
            return (await trainer.train_step.route(batch))[1]["grad_norm"]
        finally:
            await trainer.shutdown()

    one, two = asyncio.run(grad_norm(1)), asyncio.run(grad_norm(2))
    assert two == pytest.approx(one, rel=1e-4)


def test_a_batch_sampled_at_a_temperature_is_on_policy_at_it(tiny_model_dir):
    """Episodes whose tokens were sampled at temperature 0.5 carry it into the batch: the trainer's
    logprobs (its endpoint's and its step's) and the reference's are those of the logits over it,
    so on-policy the importance ratio is 1, not that of the distribution at 1."""
    from services import titan
    from services.reference import Reference

    batch = fixed_batch(3, temperatures=[1.0] * 4 + [0.5] * 8)
    with torch.no_grad():
        want = titan.token_logprobs(
            titan.load_hf_model(tiny_model_dir), batch.input_ids, temperatures=batch.temperatures
        )
    batch = on_policy(batch, want[0])

    async def main():
        cfg = TrainerConfig(lr=1e-3, loss=LossConfig(name="reinforce"))
        trainer = await Trainer.options().as_service(str(tiny_model_dir), cfg, None)
        ref = await Reference.options().as_service(str(tiny_model_dir))
        try:
            got = await trainer.logprobs.route(batch), await ref.logprobs.route(batch)
            return got, (await trainer.train_step.route(batch))[1]
        finally:
            await trainer.shutdown()
            await ref.shutdown()

    got, metrics = asyncio.run(main())
    assert max((g - want[0]).abs().max().item() for g in got) <= 1e-5
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
