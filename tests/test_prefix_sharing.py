"""Prefix-shared packing (collate's `share_prefix`): a group's prompt once per row, each sample
seeing the prompt and itself only, at the positions it has alone; every family's logprobs and
gradients equal to one-sample-per-row packing within 1e-5 (fp32)."""

import contextlib

import pytest
import torch

from forge.losses import get_loss
from forge.schema import LoRAConfig, LossConfig
from forge.types import MEMBERS, Episode, collate, shared_prompt
from services import models, titan
from services.lora import adapters_off
from services.schema import TinyModelSpec
from services.tiny_model import make_tiny_model
from tests.test_models import FAMILIES


def group(prompt: list[int], completions: list[list[int]], advantages: list[float]) -> list[Episode]:
    return [
        Episode(
            tokens=prompt + c,
            loss_mask=[0] * len(prompt) + [1] * len(c),
            gen_logprobs=[0.0] * len(prompt) + [-1.0] * len(c),
            advantage=a,
        )
        for c, a in zip(completions, advantages)
    ]


def batch_of_groups(vocab: int = 100, seed: int = 0) -> list[Episode]:
    """Two groups of 3 (prompts of 9 and 6 tokens, completions of 1-5), a lone episode, and a
    multi-turn one (the environment's tokens between its own) in a group of 2."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    episodes = group(toks(9), [toks(n) for n in (3, 5, 1)], [1.0, -0.5, 0.25])
    episodes += group(toks(6), [toks(n) for n in (4, 2, 4)], [0.5, -1.0, 2.0])
    episodes += group(toks(5), [toks(3)], [1.5])
    prompt = toks(7)
    for a in (1.0, -1.0):
        turns = toks(3), toks(4), toks(2)
        episodes.append(
            Episode(
                tokens=prompt + turns[0] + turns[1] + turns[2],
                loss_mask=[0] * 7 + [1] * 3 + [0] * 4 + [1] * 2,
                gen_logprobs=[0.0] * 16,
                advantage=a,
            )
        )
    return episodes


def seen_by_episode(batch, row: int) -> list[set[int]]:
    """The episodes each column of `row` belongs to: its own, or all that share its prompt."""
    docs = batch.doc_ids[row].tolist()
    segs = batch.segments[row].tolist()
    owners = [{d} if d >= 0 else set() for d in docs]
    for col, d in enumerate(docs):  # a shared prompt belongs to the members of its unit
        if d >= 0:
            for k, s in enumerate(segs):
                if k < col and docs[k] < 0 and s == segs[col] - segs[col] % MEMBERS:  # not padding
                    owners[k].add(d)
    return owners


def test_a_sample_sees_its_prompt_and_itself_only_at_its_own_positions():
    episodes = batch_of_groups()
    b = collate(episodes, pad_id=0, share_prefix="always")
    whole = collate(episodes, pad_id=0)
    mask = titan.packed_causal_mask(b.positions, b.segments)[:, 0]
    assert b.input_ids.numel() < whole.input_ids.numel()
    for r in range(b.input_ids.shape[0]):
        owners = seen_by_episode(b, r)
        for q, d in enumerate(b.doc_ids[r].tolist()):
            if d < 0:
                continue
            # exactly the earlier columns that are its own or its prompt's: never another sample's
            want = [k <= q and d in owners[k] for k in range(len(owners))]
            assert mask[r, q].tolist() == want, (r, q)
        for d in set(b.doc_ids[r].tolist()) - {-1}:
            cols = [k for k in range(len(owners)) if d in owners[k]]
            # its tokens in order, at the positions it has alone
            assert b.input_ids[r, cols].tolist() == episodes[d].tokens
            assert b.positions[r, cols].tolist() == list(range(len(episodes[d].tokens)))
            lm = b.loss_mask[r, cols]
            assert lm.tolist() == [float(m) for m in episodes[d].loss_mask]
    # every loss token is laid out once, with its advantage
    assert b.loss_mask.sum() == whole.loss_mask.sum()
    assert sorted(b.advantages[b.loss_mask > 0].tolist()) == sorted(whole.advantages[whole.loss_mask > 0].tolist())
    assert b.longest_episode == whole.longest_episode == max(len(e.tokens) for e in episodes)


def test_pairs_share_their_prompt_and_a_long_group_is_split_to_fit_its_rows():
    episodes = batch_of_groups()[:6]
    pairs = collate(episodes, pad_id=0, keep_together=2, share_prefix="always")
    assert pairs.num_episodes == 6 and (pairs.doc_ids[pairs.loss_mask > 0] >= 0).all()
    rows = collate(episodes[:3], pad_id=0, pack_to=16, share_prefix="always")
    # 9 + (3 + 5 + 1) completion tokens and each member's copy of the prompt's last token: two units
    assert rows.input_ids.shape[1] <= 16 and (rows.segments % MEMBERS == 0).sum() >= 2 * 8


def test_a_group_shares_its_prompt_where_that_costs_less():
    """By default a group shares where its row attends over fewer token pairs than its samples'
    rows (a dense mask computes them all): long prompts with short answers; a short prompt with
    long answers stays a row per sample, laid out exactly as without sharing."""
    long_prompt = group(list(range(5, 69)), [[70] * 4] * 8, [1.0] * 8)
    short_prompt = group([5, 6, 7], [[70] * 30] * 8, [1.0] * 8)
    assert collate(long_prompt, pad_id=0, share_prefix=True).segments is not None
    b = collate(short_prompt, pad_id=0, share_prefix=True)
    plain = collate(short_prompt, pad_id=0)
    assert b.segments is None and b.positions is None and torch.equal(b.input_ids, plain.input_ids)
    assert collate(short_prompt, pad_id=0, share_prefix="always").segments is not None


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    spec = TinyModelSpec(family=request.param, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", spec)


def step(model, batch, lora: bool = False):
    """The trainer's step on `batch` with the GRPO loss and its KL to the reference (with LoRA:
    the adapters off): the loss tokens' logprobs and entropies (in episode order), the loss, and
    every gradient."""
    model.zero_grad()
    lp, ent = titan.token_logprobs(
        model,
        batch.input_ids,
        with_entropy=True,
        positions=batch.positions,
        segments=batch.segments,
        routed_experts=batch.routed_experts,
    )
    with torch.no_grad(), adapters_off(model) if lora else contextlib.nullcontext():
        ref = titan.token_logprobs(
            model,
            batch.input_ids,
            positions=batch.positions,
            segments=batch.segments,
            routed_experts=batch.routed_experts,
        )
        batch.ref_logprobs = ref[0]
    loss = get_loss("grpo")(lp, batch, torch.ones_like(lp), LossConfig(name="grpo", kl_coef=0.1))
    loss.backward()
    own = batch.loss_mask > 0
    order = torch.argsort(batch.doc_ids[own] * 10_000 + batch.positions[own])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp[own][order].detach(), ent[own][order], loss.detach(), grads


def same(shared, whole) -> None:
    for got, want in zip(shared[:3], whole[:3]):
        assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-5
    assert shared[3] and shared[3].keys() == whole[3].keys()
    assert all((shared[3][n] - whole[3][n]).abs().max().item() <= 1e-5 for n in whole[3])


def routed(episodes: list[Episode], model_dir) -> None:
    """Recorded routes for every token (a MoE's), alike on a prompt its group shares."""
    hf = models.hf_config(model_dir)
    experts, layers = hf.get("num_experts") or hf["num_local_experts"], hf["num_hidden_layers"]
    for e in episodes:
        g = torch.Generator().manual_seed(len(e.tokens))
        first = torch.randint(0, experts, (len(e.tokens), layers, 1), generator=g)
        e.routed_experts = torch.cat([first, (first + 1) % experts], dim=2)  # top 2, distinct
    for a, b in zip(episodes, episodes[1:]):
        p = min(shared_prompt(a), shared_prompt(b)) + 1
        if a.tokens[:p] == b.tokens[:p]:
            b.routed_experts[:p] = a.routed_experts[:p]


def test_every_family_trains_alike_with_the_prompt_shared(tiny):
    """Logprobs, entropies, the loss and every gradient within 1e-5 of one episode per row
    (packed: the same positions); a MoE replays recorded routes, its shared prompt's once."""
    model = titan.load_hf_model(tiny)
    episodes = batch_of_groups()
    if models.hf_config(tiny).get("num_experts_per_tok"):
        routed(episodes, tiny)
    same(step(model, collate(episodes, pad_id=0, share_prefix="always")), step(model, collate(episodes, 0, pack_to=1)))


def test_a_lora_policy_and_its_adapter_off_reference_share_the_prompt_alike(tmp_path):
    spec = TinyModelSpec(family="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    model_dir = make_tiny_model(tmp_path / "model", spec)
    model = titan.load_hf_model(model_dir, lora=LoRAConfig(rank=4, alpha=8))
    with torch.no_grad():  # adapters that change the outputs, so the reference differs
        for n, p in model.named_parameters():
            if "lora_b" in n:
                p.normal_(0, 0.05)
    episodes = batch_of_groups()
    shared = step(model, collate(episodes, pad_id=0, share_prefix="always"), lora=True)
    same(shared, step(model, collate(episodes, pad_id=0, pack_to=1), lora=True))


def test_flex_attention_takes_the_shared_prompt_as_sdpa_does(tiny_model_dir, monkeypatch):
    """Off CPU the families attend through torchtitan's FlexAttention, whose block mask forge
    builds from the segments (its own knows documents only); its forward runs here too."""
    from services.models import layers

    b = collate(batch_of_groups(), pad_id=0, share_prefix="always")
    own = b.loss_mask > 0
    with torch.no_grad():
        sdpa = titan.token_logprobs(titan.load_hf_model(tiny_model_dir), b.input_ids, positions=b.positions)
        cpu_choice = layers.attention_config
        monkeypatch.setattr(layers, "attention_config", lambda device_type: cpu_choice("cuda"))
        flex = titan.load_hf_model(tiny_model_dir)
        assert isinstance(flex.config.first_attention.inner_attention, layers.FlexAttention.Config)
        shared = titan.token_logprobs(flex, b.input_ids, positions=b.positions, segments=b.segments)[0]
        want = titan.token_logprobs(
            titan.load_hf_model(tiny_model_dir), b.input_ids, positions=b.positions, segments=b.segments
        )[0]
    assert (shared[own] - want[own]).abs().max().item() <= 1e-5
    assert (sdpa[0][own] - want[own]).abs().max().item() > 1e-3  # without the segments: another attention


def test_the_trainer_takes_the_same_step_from_shared_rows(tiny_model_dir):
    """Through the Trainer service (FSDP, two micro-batches): loss, gradient norm, entropy and
    tokens of a step on shared rows equal a row per sample's, Dr.GRPO's norm included."""
    import asyncio

    from services.schema import TrainerConfig
    from services.trainer import Trainer

    episodes = batch_of_groups()

    async def step(batch) -> dict:
        cfg = TrainerConfig(lr=0.0, grad_accum=2, loss=LossConfig(name="dr_grpo"))
        trainer = await Trainer.options().as_service(str(tiny_model_dir), cfg)
        try:
            return (await trainer.train_step.route(batch))[1]
        finally:
            await trainer.shutdown()

    whole = asyncio.run(step(collate(episodes, pad_id=0, rows_multiple_of=2)))
    shared = asyncio.run(step(collate(episodes, pad_id=0, rows_multiple_of=2, share_prefix="always")))
    for key in ("loss", "grad_norm", "entropy", "trained_tokens"):
        assert abs(whole[key] - shared[key]) <= 1e-5 * max(1.0, abs(whole[key])), (key, whole[key], shared[key])


def test_a_moe_sample_replays_its_own_routes_on_the_prompt_it_shares():
    """Two groups of one prompt routed differently there (sampled on other weights, or one found
    the prompt in the generator's prefix cache: -1) do not share it: every token a sample sees,
    its prompt's included, replays that sample's own record, as on a row of its own."""
    prompt = list(range(5, 14))
    episodes = group(prompt, [[20, 21], [22], [23, 24, 25]], [1.0, -1.0, 0.5])
    episodes += group(prompt, [[30], [31, 32]], [0.5, -0.5])
    for k, e in enumerate(episodes):
        own = torch.full((len(e.tokens), 2, 2), k, dtype=torch.int16)
        own[: len(prompt)] = 0 if k < 3 else 1  # alike within a group, not across the two
        e.routed_experts = own
    b = collate(episodes, pad_id=0, share_prefix="always")
    for r in range(b.input_ids.shape[0]):
        owners = seen_by_episode(b, r) if b.segments is not None else [{d} for d in b.doc_ids[r].tolist()]
        for d in set(b.doc_ids[r].tolist()) - {-1}:
            cols = [k for k in range(len(owners)) if d in owners[k]]
            assert torch.equal(b.routed_experts[r, cols], episodes[d].routed_experts.long()), d
