"""Routing replay (R3) on the tiny MoE: the generator records the experts vLLM routed each token
to, the record travels with the Completion and Episode into the Batch, and the trainer's forward
routes exactly as recorded."""

import asyncio

import numpy as np
import pytest
import torch

from forge.types import Episode, collate
from services import titan
from services.generator import Generator
from services.models.layers import ReplayRouter
from services.schema import GeneratorConfig


@pytest.fixture(scope="module")
def moe_served(loop, tiny_moe_dir):
    """A generator of the tiny MoE (routing replay on: the default for a MoE) and a gateway over it."""
    from services.gateway import Gateway
    from services.schema import GatewayConfig

    cfg = GeneratorConfig(max_model_len=128)

    async def start():
        gen = await Generator.options().as_service(str(tiny_moe_dir), cfg)
        return gen, await Gateway.start(gen, tiny_moe_dir, GatewayConfig(served_model_name="moe"), cfg)

    gen, gw = loop.run_until_complete(start())
    yield gen, gw
    loop.run_until_complete(gw.shutdown())
    loop.run_until_complete(gen.shutdown())


@pytest.fixture(scope="module")
def moe_completions(loop, moe_served):
    gen, _ = moe_served

    async def sample():
        prompts = ("rev abc=", "12+7=", "sort cba=")
        return await asyncio.gather(*(gen.generate.route(p, n=4, sampling={"max_tokens": 16}) for p in prompts))

    return [c for g in loop.run_until_complete(sample()) for c in g]


def hf_routing(model_dir, tokens: list[int]) -> torch.Tensor:
    """The top-k experts of each layer for each token under transformers' fp32 forward, [seq, layers, k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k, dim=-1).indices.sort(-1).values for logits in out.router_logits], dim=1)


def agreement(model_dir, tokens: list[int], record: torch.Tensor) -> tuple[int, int]:
    """(layer x token pairs where `record` names the experts transformers routes to, pairs recorded)."""
    recorded = (record >= 0).all(-1)
    same = (record.long().sort(-1).values == hf_routing(model_dir, tokens)).all(-1)
    return (same & recorded).sum().item(), recorded.sum().item()


def test_the_generator_records_the_experts_it_routed_to(moe_completions, tiny_moe_dir):
    """Every computed position of every sample has a record (the shared prompt filled in from the
    sample that computed it), the last sampled token none, and the record is the routing of that
    very token at that position: transformers, on the same fp32 weights, picks the same experts."""
    agree = total = 0
    for c in moe_completions:
        n = len(c.prompt_ids) + len(c.token_ids)
        assert c.routed_experts.shape == (n, 4, 2) and c.routed_experts.dtype == torch.int16
        assert (c.routed_experts[:-1] >= 0).all() and (c.routed_experts[-1] == -1).all()
        same, recorded = agreement(tiny_moe_dir, c.prompt_ids + c.token_ids, c.routed_experts)
        agree, total = agree + same, total + recorded
    assert agree / total >= 0.99, (agree, total)  # a record shifted by one position agrees ~1 time in 6


def test_a_gateway_session_carries_its_routing_into_the_episode(loop, moe_served, tiny_moe_dir):
    """Two chat turns through the gateway (as an agent makes them): the episode's record covers
    every token but the last sampled one, each as the turn that computed it routed it."""
    import openai
    from transformers import AutoTokenizer

    _, gw = moe_served
    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    # Letters only (and the turn's end): the reply re-renders as the very tokens sampled, so the
    # second turn extends the first into one episode.
    allowed = {"allowed_token_ids": [tok.convert_tokens_to_ids(x) for x in [*"abcdefghij", "<|im_end|>"]]}

    async def main():
        sid = gw.open_session()
        c = openai.AsyncOpenAI(base_url=gw.base_url, api_key=sid, max_retries=0)
        messages = [{"role": "user", "content": "rev abc="}]
        r = await c.chat.completions.create(model="moe", messages=messages, max_tokens=6, extra_body=allowed)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "again"},
        ]
        await c.chat.completions.create(model="moe", messages=messages, max_tokens=6, extra_body=allowed)
        return await gw.finish(sid)

    record = loop.run_until_complete(main())
    [episode] = record.samples()
    assert len(record.turns) == 2 and episode.routed_experts.shape == (len(episode.tokens), 4, 2)
    assert (episode.routed_experts[:-1] >= 0).all()
    same, recorded = agreement(tiny_moe_dir, episode.tokens, episode.routed_experts)
    assert recorded == (len(episode.tokens) - 1) * 4 and same / recorded >= 0.99


@pytest.mark.parametrize("pack_to", [0, 64])
def test_the_trainer_routes_as_the_generator_did(moe_completions, tiny_moe_dir, pack_to):
    """With its gate perturbed, the trainer's own router picks other experts; given the batch's
    records it routes each recorded token exactly as the generator did (rows or packed rows), and
    only tokens without a record (-1) as it would itself."""
    episodes = [Episode.from_completion(c) for c in moe_completions]
    batch = collate(episodes, pad_id=0, pack_to=pack_to)
    model = titan.load_hf_model(tiny_moe_dir)
    with torch.no_grad():
        for layer in model.layers.values():
            layer.moe.router.gate.weight.add_(torch.randn_like(layer.moe.router.gate.weight))
    used = {}

    def note(layer: int):
        return lambda module, args, out: used.__setitem__(layer, out[1:])  # (expert ids, scores)

    for name, m in model.named_modules():
        if isinstance(m, ReplayRouter):
            m.register_forward_hook(note(int(name.split(".")[1])))

    def routing(routed_experts):
        with torch.no_grad():
            titan.token_logprobs(model, batch.input_ids, positions=batch.positions, routed_experts=routed_experts)
        ids = torch.stack([used[i][0] for i in range(4)], dim=2)  # [rows, seq, layers, k]
        own = torch.stack([used[i][1].topk(2, dim=-1).indices for i in range(4)], dim=2)  # its top-k there
        return ids.sort(-1).values, own.sort(-1).values

    recorded = (batch.routed_experts >= 0).all(-1)
    (replayed, own_there), (own, _) = routing(batch.routed_experts), routing(None)
    assert torch.equal(replayed[recorded], batch.routed_experts[recorded].sort(-1).values)
    assert torch.equal(replayed[~recorded], own_there[~recorded])
    differ = (own[recorded].sort(-1).values != batch.routed_experts[recorded].sort(-1).values).any(-1)
    assert differ.float().mean() > 0.2  # without the replay, the perturbed router goes elsewhere


def test_a_request_takes_only_its_own_routing_records():
    """vLLM names engine requests "<id>-<suffix>" (n > 1: "<index>_<id>-<suffix>"). A request
    whose id is a prefix of another's takes only its own
    records, never that other request's."""
    from services.vllm_routing import RoutingRecorder

    rec = RoutingRecorder(num_layers=1, top_k=1)
    for key, expert in (("ab-1a2b3c4d", 1), ("0_abc-5e6f7a8b", 2), ("1_abc-5e6f7a8b", 3)):
        rec.records[key] = np.full((2, 1, 1), expert, dtype=np.int16)
    assert sorted(rec.take("ab")) == [0] and set(rec.records) == {"0_abc-5e6f7a8b", "1_abc-5e6f7a8b"}
    taken = rec.take("abc")
    assert {i: np.frombuffer(data, np.int16)[0] for i, (_, data) in taken.items()} == {0: 2, 1: 3}
    assert rec.take("abc") == {} and not rec.records  # once
