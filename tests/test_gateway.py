"""The OpenAI-compatible gateway, used as agents use it: the `openai` async client against one
live gateway over one generator (the tiny model), shared by the module."""

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import as_a_user
from fastapi import APIRouter

MODEL_NAME = "tiny"  # the fixture `served` (conftest.py) serves the tiny model under this name
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture(scope="module")
def letters(tiny_model_dir):
    """Token ids the tests let the model sample (so its text re-tokenizes to the same ids),
    and <|im_end|>, which ends a chat turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tok, [tok.convert_tokens_to_ids(c) for c in "abcdefghij"] + [tok.convert_tokens_to_ids("<|im_end|>")]


def client(gw, key):
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


def chat(c, messages, **kw):
    return c.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)


def streamed(gw, sid, content, **kw):
    """A streamed chat completion of one user message, in session `sid`."""
    return chat(client(gw, sid), [{"role": "user", "content": content}], stream=True, **kw)


def test_ctrl_c_stays_the_runs(loop, served):
    """The gateway serves inside a run: SIGINT stays the process's (a run saves a checkpoint on
    Ctrl-C), not uvicorn's, which would close the gateway and leave the run's episodes failing."""
    import signal

    async def handler():
        await asyncio.sleep(0.05)  # inside the loop the gateway serves on
        return signal.getsignal(signal.SIGINT)

    gw = served[0]
    assert getattr(loop.run_until_complete(handler()), "__self__", None) is not gw._server


def test_the_gateway_runs_no_middleware_for_what_it_does_not_serve(served):
    """vLLM's app comes with per-request middleware (Prometheus's HTTP metrics, elastic-EP
    scaling, CORS) for routes and features the gateway does not serve; each call paid for it."""
    layer, layers = served[0]._server.config.app.app.middleware_stack, []
    while layer is not None and not isinstance(layer, APIRouter):  # the layers a request goes through
        layers.append(type(layer).__name__)
        layer = layer.app
    assert layers == ["ServerErrorMiddleware", "ExceptionMiddleware", "AsyncExitStackMiddleware"]
    assert not served[0]._server.config.proxy_headers


def test_chat_logprobs_n_models_and_completions(loop, served):
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        r = await chat(
            c,
            [{"role": "user", "content": "rev abc="}],
            n=3,
            max_tokens=6,
            logprobs=True,
            top_logprobs=2,
            temperature=1.0,
            seed=1,
            extra_body={"return_token_ids": True},
        )
        models = await c.models.list()
        # ignore_eos: four tokens whatever the sampled ones are (EOS among them would end it early)
        text = await c.completions.create(
            model=MODEL_NAME, prompt="rev abc=", max_tokens=4, logprobs=1, extra_body={"ignore_eos": True}
        )
        ids = await c.completions.create(model=MODEL_NAME, prompt=[4, 5, 6], max_tokens=4)
        return r, models, text, ids, await gw.finish(sid)

    r, models, text, ids, record = loop.run_until_complete(main())
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert len(r.choices) == 3 and all(len(ch.logprobs.content) == len(ch.token_ids) for ch in r.choices)
    assert all(len(t.top_logprobs) == 2 for ch in r.choices for t in ch.logprobs.content)
    assert len(text.choices[0].logprobs.tokens) == 4 and ids.choices[0].text is not None
    # Every call was recorded: the chat's prompt ids, each choice's sampled ids and their logprobs.
    turn = record.turns[0]
    assert turn.prompt_ids == r.prompt_token_ids and len(record.turns) == 3
    for i, ch in enumerate(r.choices):
        assert turn.token_ids[i] == ch.token_ids
        assert turn.logprobs[i] == pytest.approx([t.logprob for t in ch.logprobs.content], abs=1e-6)
    assert record.turns[2].prompt_ids == [4, 5, 6]


def test_episode_clients_share_one_ssl_context(loop, served, monkeypatch):
    """`Gateway.client` makes an episode's client without a new SSL context: httpx makes one per
    client (loading the CA bundle), which cost the controller half its CPU at 64 episodes in
    flight. Each client still works on its own and is closed on its own."""
    import ssl

    gw, *_ = served
    made = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: made.append(1) or real(*a, **kw))

    async def main():
        sessions = [gw.open_session() for _ in range(20)]
        clients = [gw.client(s) for s in sessions]
        models = await asyncio.gather(*(c.models.list() for c in clients[:2]))
        for c, s in zip(clients, sessions):
            await c.close()
            await gw.finish(s)
        return models, clients

    models, clients = loop.run_until_complete(main())
    assert made == [] and all(m.data[0].id == MODEL_NAME for m in models)
    assert all(c._client.is_closed for c in clients)


def test_streaming_is_server_sent_events(loop, served):
    """A streamed answer comes in chunks; the record holds each sampled token's logprob as the
    chunks showed it (vLLM's outputs come in pieces, each with the logprobs of its own tokens)."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        stream = await streamed(
            gw,
            sid,
            "12+7=",
            max_tokens=8,
            temperature=1.0,
            logprobs=True,
            top_logprobs=2,
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
        return chunks, await gw.finish(sid)

    chunks, record = loop.run_until_complete(main())
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert len(deltas) >= 2 and chunks[-1].usage.completion_tokens == len(record.turns[0].token_ids[0])
    shown = [
        t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content
    ]
    assert record.turns[0].logprobs[0] == pytest.approx(shown, abs=1e-6)


def test_tool_call_round_trip(loop, served, tiny_model_dir):
    """The template lists the tool, the model's call comes back parsed as `tool_calls`, and the
    tool's answer goes back in; the call and the answer are in the next prompt, token for token."""
    gw, *_ = served
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        messages = [{"role": "user", "content": "1+2="}]
        # The tiny model cannot call tools yet: structured output makes it emit a call, ended by
        # <|im_end|> as the template renders it (not the tiny model's other EOS, <|eos|> = 2), its
        # tags as their tokens (as the template renders them), not spelled out in characters.
        first = await chat(
            c,
            messages,
            tools=[ADD_TOOL],
            max_tokens=80,
            logit_bias={"2": -100, str(tok.convert_tokens_to_ids("<")): -100},
            extra_body={"structured_outputs": {"regex": CALL.replace("{", r"\{").replace("}", r"\}")}},
        )
        call = first.choices[0].message.tool_calls[0]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "3"},
        ]
        second = await chat(c, messages, tools=[ADD_TOOL], max_tokens=4)
        return first, second, await gw.finish(sid)

    first, second, record = loop.run_until_complete(main())
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert first.choices[0].finish_reason == "tool_calls" and second.choices[0].message.content is not None
    rendered = tok.decode(record.turns[0].prompt_ids)
    assert '"name": "add"' in rendered and "<tools>" in rendered
    again = tok.decode(record.turns[1].prompt_ids)
    assert CALL in again and "<tool_response>3</tool_response>" in again
    # The call re-rendered from tool_calls is the sampled text: one sequence for both turns.
    assert record.new_sample_at == [] and len(record.samples()) == 1


TEMPERATURES = (1.0, 0.5, 0.8)


def test_three_turns_are_one_sample_with_the_generators_tokens_and_logprobs(loop, served, letters, tiny_model_dir):
    """The recording of a 3-turn chat is what the generator sampled (ids and logprobs as the
    responses report them); the turns extend each other, so they are one sequence whose
    sampled-token logprobs equal an fp32 transformers forward of it (1e-4), each turn's tokens
    at the temperature the agent asked for it (which the episode carries to the trainer)."""
    gw, *_ = served
    tok, allowed = letters

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        messages, responses = [], []
        for question, temperature in zip(("rev abc=", "sort dcba=", "rev xyz="), TEMPERATURES):
            messages.append({"role": "user", "content": question})
            r = await chat(
                c,
                messages,
                max_tokens=6,
                logprobs=True,
                temperature=temperature,
                extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
            )
            responses.append(r)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        return responses, await gw.finish(sid)

    responses, record = loop.run_until_complete(main())
    assert len(record.turns) == 3 and record.new_sample_at == []
    for turn, r in zip(record.turns, responses):
        assert turn.prompt_ids == r.prompt_token_ids and turn.token_ids[0] == r.choices[0].token_ids
        assert turn.logprobs[0] == pytest.approx([t.logprob for t in r.choices[0].logprobs.content], abs=1e-6)
    [episode] = record.samples()
    assert episode.tokens[: len(record.turns[2].prompt_ids)] == record.turns[2].prompt_ids
    assert sum(episode.loss_mask) == sum(len(t.token_ids[0]) for t in record.turns)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([episode.tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    # The tokens were sampled from the allowed ones only: that is the distribution to compare with.
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed]
    temperatures = [1.0] * len(episode.tokens)
    for turn, t in zip(record.turns, TEMPERATURES):  # each turn's sampled tokens, where they are
        start = len(turn.prompt_ids)
        temperatures[start : start + len(turn.token_ids[0])] = [t] * len(turn.token_ids[0])
    assert episode.temperatures == temperatures
    lp = torch.log_softmax(masked / torch.tensor(temperatures[1:])[:, None], -1).gather(-1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(episode.loss_mask[1:], dtype=torch.bool)
    assert (lp[mask] - torch.tensor(episode.gen_logprobs[1:])[mask]).abs().max().item() <= 1e-4


def test_edited_history_falls_back_to_one_sample_per_turn(loop, served, letters):
    """The template drops the reasoning of earlier turns, and an agent may rewrite its history:
    either way the next prompt does not extend the last one, and the recording says so."""
    gw, *_ = served
    _, allowed = letters

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        messages = [{"role": "user", "content": "rev abc="}]
        think = await chat(
            c, messages, max_tokens=20, extra_body={"structured_outputs": {"regex": "<think>[a-c]{2}</think>[a-c]{2}"}}
        )
        messages += [
            {"role": "assistant", "content": think.choices[0].message.content},
            {"role": "user", "content": "and again"},
        ]
        plain = await chat(c, messages, max_tokens=4, extra_body={"allowed_token_ids": allowed})
        messages += [{"role": "assistant", "content": "something it never said"}, {"role": "user", "content": "?"}]
        await chat(c, messages, max_tokens=4, extra_body={"allowed_token_ids": allowed})
        return think, plain, await gw.finish(sid)

    think, plain, record = loop.run_until_complete(main())
    assert "</think>" in think.choices[0].message.content
    assert record.new_sample_at == [1, 2] and len(record.samples()) == 3
    for episode, turn in zip(record.samples(), record.turns):  # each turn alone: its prompt, then its tokens
        assert episode.tokens == turn.prompt_ids + turn.token_ids[0]


def test_the_samples_of_one_line_of_turns_are_the_parts_of_one_episode():
    """A turn that does not extend the last (a re-rendered history) starts a sample: when every
    turn is in one sample, in order, the samples are the parts of one episode (a critic's returns
    run on from one to the next); a turn of two choices branches, and one sample is the episode."""
    from forge.types import continued
    from services.gateway import SessionRecord, Turn

    def turn(prompt, sampled, n=1):
        return Turn(prompt, [sampled] * n, [[-0.1] * len(sampled)] * n, ["stop"] * n, (0, 0))

    cut = SessionRecord("key", [turn([1, 2], [5]), turn([1, 9, 5, 3], [6]), turn([1, 9, 5, 3, 6, 4], [7])])
    a, b = cut.samples()
    assert cut.new_sample_at == [1] and b.tokens == [1, 9, 5, 3, 6, 4, 7]
    assert a.part[0] == b.part[0] != "key" and (a.part[1], b.part[1]) == (0, 1)  # not the session: its API key
    assert continued([a, b]).tolist() == [True, False]
    branched = SessionRecord("key", [turn([1, 2], [5], n=2), turn([1, 2, 5, 3], [6])])
    assert len(branched.samples()) == 2 and all(e.part is None for e in branched.samples())
    assert SessionRecord("key", [turn([1, 2], [5]), turn([1, 2, 5, 3], [6])]).samples()[0].part is None


def test_sessions_interleave_and_stay_apart(loop, served, letters):
    gw, *_ = served
    _, allowed = letters

    async def conversation(question: str) -> tuple[str, list]:
        sid = gw.open_session()
        c, messages = client(gw, sid), []
        for _ in range(3):
            messages.append({"role": "user", "content": question})
            r = await chat(c, messages, max_tokens=4, extra_body={"allowed_token_ids": allowed})
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        return sid, await gw.finish(sid)

    async def main():
        return await asyncio.gather(conversation("rev abc="), conversation("sort hgf="))

    (a, rec_a), (b, rec_b) = loop.run_until_complete(main())
    assert a != b and len(rec_a.turns) == len(rec_b.turns) == 3
    assert len(rec_a.samples()) == len(rec_b.samples()) == 1
    assert rec_a.samples()[0].tokens != rec_b.samples()[0].tokens


def test_refusals_name_what_is_wrong(loop, served):
    gw, gen, *_ = served

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        errors = {}
        for name, call in [
            ("unknown session", chat(client(gw, "sk-nobody"), [{"role": "user", "content": "hi"}])),
            ("field", chat(c, [{"role": "user", "content": "hi"}], temperature="hot")),
            ("too long", chat(c, [{"role": "user", "content": "x" * 600}])),
        ]:
            try:
                await call
            except openai.APIStatusError as e:
                errors[name] = e
        async with httpx.AsyncClient() as h:
            bad_json = await h.post(
                f"{gw.base_url}/chat/completions",
                content=b"{not json",
                headers={"Authorization": f"Bearer {sid}", "Content-Type": "application/json"},
            )
            health = await h.get(gw.base_url.removesuffix("/v1") + "/health")
        # Overload: past max_inflight a request is refused at once, not queued.
        gw.cfg.max_inflight = 1
        try:
            slow = asyncio.ensure_future(
                chat(c, [{"role": "user", "content": "hi"}], max_tokens=200, extra_body={"ignore_eos": True})
            )
            await asyncio.sleep(0.3)
            try:
                await chat(c, [{"role": "user", "content": "hi"}], max_tokens=2)
            except openai.RateLimitError as e:
                errors["overload"] = e
            await slow
        finally:
            gw.cfg.max_inflight = 512
        await gw.finish(sid)
        return errors, bad_json, health

    errors, bad_json, health = loop.run_until_complete(main())
    assert errors["unknown session"].status_code == 401 and "unknown session" in str(errors["unknown session"])
    assert errors["field"].status_code == 400 and "temperature" in str(errors["field"])
    assert errors["too long"].status_code == 400 and "maximum context length is 512" in str(errors["too long"])
    assert errors["overload"].status_code == 429 and "max_inflight" in str(errors["overload"])
    assert bad_json.status_code == 400 and "JSON" in bad_json.text
    assert health.status_code == 200


HI = [{"role": "user", "content": "hi"}]


def test_only_forges_routes_are_served(loop, served):
    """vLLM's other routes that generate (/v1/responses, /v1/messages, /invocations) would skip
    max_inflight, the health check, the limits and the session's record: 404, naming what is
    served."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        root, body = (
            gw.base_url.removesuffix("/v1"),
            {"model": MODEL_NAME, "messages": HI, "input": "hi", "max_tokens": 2},
        )
        async with httpx.AsyncClient() as h:
            paths = ("/v1/responses", "/v1/messages", "/invocations", "/v1/chat/completions/render")
            got = {p: await h.post(root + p, json=body, headers={"Authorization": f"Bearer {sid}"}) for p in paths}
        return got, await gw.finish(sid)

    got, record = loop.run_until_complete(main())
    for path, r in got.items():
        assert r.status_code == 404 and f"{path} is not served here" in r.text and "/v1/chat/completions" in r.text
    assert record.turns == []


def test_request_and_session_limits(loop, served):
    """Per request (400): choices, max_tokens, body bytes; per session (429): requests in flight
    and turns recorded. Each names the gateway key; a refused call records nothing."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        c, errors = client(gw, sid), {}

        async def refused(name, **kw):
            try:
                await chat(c, HI, **kw)
            except openai.APIStatusError as e:
                errors[name] = e

        await refused("n", n=17, max_tokens=2)
        await refused("max_tokens", max_tokens=10_000)
        await refused("body", max_tokens=2, extra_body={"pad": "x" * (2 << 20)})
        saved = gw.cfg.max_session_inflight, gw.cfg.max_turns
        gw.cfg.max_session_inflight = 1
        try:
            slow = asyncio.ensure_future(chat(c, HI, max_tokens=200, extra_body={"ignore_eos": True}))
            await asyncio.sleep(0.3)
            await refused("inflight", max_tokens=2)
            await slow
            gw.cfg.max_turns = 1
            await refused("turns", max_tokens=2)
        finally:
            gw.cfg.max_session_inflight, gw.cfg.max_turns = saved
        return errors, await gw.finish(sid)

    errors, record = loop.run_until_complete(main())
    assert errors["n"].status_code == 400 and "17 choices (n × prompts) exceed the gateway's max_n (16)" in str(
        errors["n"]
    )
    assert errors["max_tokens"].status_code == 400 and "max_tokens=10000 exceeds" in str(errors["max_tokens"])
    assert errors["body"].status_code == 400 and "max_body_bytes" in str(errors["body"])
    assert errors["inflight"].status_code == 429 and "max_session_inflight" in str(errors["inflight"])
    assert errors["turns"].status_code == 429 and "max_turns" in str(errors["turns"])
    assert len(record.turns) == 1  # the slow call only


def test_request_ids_are_the_servers(loop, served):
    """A client's X-Request-Id or `request_id` would key the generator's request, and a
    duplicate's cleanup abort another's: the gateway drops both, so vLLM makes its own."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        headers = {"Authorization": f"Bearer {sid}", "X-Request-Id": "theirs"}
        body = {"model": MODEL_NAME, "messages": HI, "max_tokens": 2, "request_id": "theirs-too"}
        async with httpx.AsyncClient() as h:
            got = await asyncio.gather(
                *(h.post(f"{gw.base_url}/chat/completions", json=body, headers=headers) for _ in range(2))
            )
        return got, await gw.finish(sid)

    got, record = loop.run_until_complete(main())
    assert [r.status_code for r in got] == [200, 200] and len(record.turns) == 2
    ids = [r.json()["id"] for r in got]
    assert "theirs" not in ids[0] + ids[1] and ids[0] != ids[1]


def test_client_disconnect_mid_stream_aborts_in_vllm(loop, served):
    gw, gen, *_ = served

    async def main():
        sid = gw.open_session()
        stream = await streamed(gw, sid, "hi", max_tokens=200, extra_body={"ignore_eos": True})
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        running = await gen.unfinished_requests.route()
        await stream.close()  # the client hangs up
        deadline = time.monotonic() + 10
        while await gen.unfinished_requests.route() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return running, await gen.unfinished_requests.route(), await gw.finish(sid)

    running, after, record = loop.run_until_complete(main())
    assert running == 1 and after == 0 and record.turns == []  # aborted: nothing to train on


def test_sessions_are_bounded_and_time_out(loop, served):
    gw, *_ = served

    async def main():
        limit, timeout = gw.cfg.max_sessions, gw.cfg.session_timeout_s
        gw.cfg.max_sessions = len(gw.sessions) + 1
        try:
            sid = gw.open_session()
            with pytest.raises(RuntimeError, match="max_sessions"):
                gw.open_session()
            gw.cfg.session_timeout_s = 0.2
            gw._reaper.cancel()
            gw._reaper = asyncio.ensure_future(gw._reap())
            await asyncio.sleep(0.6)
            with pytest.raises(KeyError, match="no open session"):
                await gw.finish(sid)
        finally:
            gw.cfg.max_sessions, gw.cfg.session_timeout_s = limit, timeout

    loop.run_until_complete(main())


def test_weights_move_under_the_gateway(loop, served, tiny_model_dir):
    """The generator loads new versions while the gateway serves: each recorded turn carries
    the policy version it ran under."""
    gw, gen, weights, sync = served
    from safetensors.torch import load_file

    sd = load_file(tiny_model_dir / "model.safetensors")

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        await chat(c, [{"role": "user", "content": "a"}], max_tokens=2)
        await weights.publish(1, {k: v + 0.01 for k, v in sd.items()})
        sync.publish(1)
        await sync.wait_held(1, timeout_s=60)
        await chat(c, [{"role": "user", "content": "b"}], max_tokens=2)
        return await gw.finish(sid)

    record = loop.run_until_complete(main())
    assert [t.versions for t in record.turns] == [(0, 0), (1, 1)]


def test_an_eval_holds_the_generators_version(loop, served, tiny_model_dir):
    """While an eval holds the generator on its version, new versions wait; on release, or
    when the hold runs out, the generator moves on."""
    gw, gen, weights, sync = served
    from safetensors.torch import load_file

    sd = load_file(tiny_model_dir / "model.safetensors")

    async def publish(version: int, delta: float) -> None:
        await weights.publish(version, {k: t + delta for k, t in sd.items()})
        sync.publish(version)

    async def main():
        v = await gen.policy_version.route()
        async with sync.hold(v, 30.0) as held:
            assert held == v
            await publish(v + 1, 0.02)
            await asyncio.sleep(1.0)
            assert await gen.policy_version.route() == v
        await sync.wait_held(v + 1, timeout_s=60)
        never_released = sync.hold(v + 1, 1.5)
        await never_released.__aenter__()
        start = time.monotonic()
        await publish(v + 2, 0.03)
        await sync.wait_held(v + 2, timeout_s=60)
        assert time.monotonic() - start >= 1.0
        await never_released.__aexit__(None, None, None)

    loop.run_until_complete(main())


def forge_serve(*args: str, cwd: Any = None) -> tuple[Any, int, str]:
    """A `forge serve ARGS` process on a free loopback port, once it says it serves: (process, port,
    its output so far, that line last). Stop it with SIGINT. With `cwd`: as a user starts it there
    (the libraries' output in cwd/runs/serve/logs), else as the tests' processes (on the console)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge.cli", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**as_a_user(os.environ), "PYTHONUNBUFFERED": "1"} if cwd else {**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=cwd,
    )
    out = ""
    for line in proc.stdout:
        out += line
        if line.startswith("forge serve:"):
            break
    return proc, port, out


@pytest.mark.slow  # 57 s: a `forge serve` process and its engine
def test_forge_serve_with_the_openai_client(tiny_model_dir, tmp_path):
    """`forge serve` as the README shows it: an API key, the plain (sync) openai client, Ctrl-C;
    nothing on the console but its own lines."""
    import signal

    import psutil

    proc, port, started = forge_serve(str(tiny_model_dir), "--api-key", "k1", "--max-model-len", "512", cwd=tmp_path)
    try:
        # The console holds forge's lines alone (its advice on CPU: tcmalloc); vLLM's and Monarch's
        # are in runs/serve/logs.
        *advice, line = started.splitlines()
        assert line == f"forge serve: model 'test-tiny' (1 replica(s)) on http://127.0.0.1:{port}/v1; Ctrl-C stops"
        assert all(a.startswith("forge: vLLM on CPU runs slower without tcmalloc") for a in advice), advice
        children = psutil.Process(proc.pid).children(recursive=True)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0)
        r = c.chat.completions.create(
            model="test-tiny", messages=[{"role": "user", "content": "rev abc="}], max_tokens=4
        )
        assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k2", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-2000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert not out.strip(), out[-2000:]
    logs = {p.name.rsplit("-", 1)[0] for p in (tmp_path / "runs/serve/logs").glob("*.log")}
    assert {"main", "generator"} <= logs and "Resolved architecture" in "".join(
        p.read_text() for p in (tmp_path / "runs/serve/logs").glob("generator-*.log")
    )


def test_forge_serve_beyond_loopback_needs_a_key(tiny_model_dir, monkeypatch, capsys):
    """Anyone who reaches a non-loopback address could generate on a keyless `forge serve`: it
    refuses to listen there without a key, before any engine starts, and names both ways to give
    one; FORGE_API_KEY keeps the key off the command line; loopback stays keyless. (Training's
    gateway authenticates by session ids, so it only warns.)"""
    import services.gateway
    from forge.cli import main
    from services.generator import Generator
    from services.schema import GatewayConfig

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started before the key was checked")

    monkeypatch.setattr(Generator, "options", no_engine)
    monkeypatch.delenv("FORGE_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_model_dir), "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert "listen on 0.0.0.0, beyond this machine, with no API key" in err and "FORGE_API_KEY" in err
    for host in ("::", "10.1.2.3", "example.org"):
        with pytest.raises(ValueError, match="no API key"):
            GatewayConfig(host=host, sessions=False).validate()
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        GatewayConfig(host=host, sessions=False).validate()
    GatewayConfig(host="0.0.0.0").validate()  # sessions: their ids are the keys

    seen = []

    async def serve(model, cfg, generator_cfg, replicas):
        cfg.validate()
        seen.append(cfg)

    monkeypatch.setattr(services.gateway, "serve", serve)
    monkeypatch.setenv("FORGE_API_KEY", "k3")
    main(["serve", str(tiny_model_dir), "--host", "0.0.0.0"])
    assert seen[0].api_key == "k3" and seen[0].host == "0.0.0.0"


def test_chat_prompts_are_the_tokens_forge_serve_renders(loop, served, tiny_model_dir):
    """Chat messages (a system turn, a user turn; and with tools) given to `Generator.generate`
    are the prompt token ids the OpenAI server renders for the same messages, which are the
    tokenizer's chat template with the generation prompt; bad messages are named."""
    from transformers import AutoTokenizer

    gw, gen, *_ = served
    messages = [{"role": "system", "content": "Reverse the letters."}, {"role": "user", "content": "rev abc="}]
    tools = [{"type": "function", "function": {"name": "rev", "parameters": {"type": "object", "properties": {}}}}]

    async def main():
        c = client(gw, gw.open_session())
        out = {}
        for name, extra in (("plain", {}), ("tools", {"tools": tools})):
            served_ = await chat(c, messages, max_tokens=1, extra_body={"return_token_ids": True}, **extra)
            [ours] = await gen.generate.route(messages, n=1, sampling={"max_tokens": 1}, **extra)
            out[name] = (served_.prompt_token_ids, ours.prompt_ids)
        with pytest.raises(ValueError, match="bad chat messages"):
            await gen.generate.route([{"role": "user", "content": 5}])
        return out

    out = loop.run_until_complete(main())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (
        out["plain"][0]
        == out["plain"][1]
        == tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    assert out["tools"][0] == out["tools"][1] != out["plain"][1]  # the tools are in the prompt, the same way


def test_chat_template_kwargs_reach_the_template_in_training_and_serving(tiny_model_dir):
    """`generator.chat_template_kwargs` ({enable_thinking: false}, as the Qwen3 configs set) reach
    the chat template when the generator renders a chat prompt and when its gateway does (vLLM's
    --default-chat-template-kwargs): both are the tokenizer's template with them, not without."""
    from transformers import AutoTokenizer

    from services.gateway import Gateway
    from services.generator import Generator
    from services.schema import GatewayConfig, GeneratorConfig

    messages = [{"role": "user", "content": "rev abc="}]
    cfg = GeneratorConfig(max_model_len=128, chat_template_kwargs={"enable_thinking": False})

    async def main():
        gen = await Generator.options().as_service(str(tiny_model_dir), cfg)
        gw = await Gateway.start(gen, tiny_model_dir, GatewayConfig(sessions=False, served_model_name=MODEL_NAME), cfg)
        try:
            [ours] = await gen.generate.route(messages, n=1, sampling={"max_tokens": 1})
            served_ = await chat(client(gw, "none"), messages, max_tokens=1, extra_body={"return_token_ids": True})
        finally:
            await gw.shutdown()
            await gen.shutdown()
        return ours.prompt_ids, served_.prompt_token_ids

    ours, served_ = asyncio.run(main())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    without = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with_kwargs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, enable_thinking=False
    )["input_ids"]
    assert ours == served_ == with_kwargs != without


# ---- attacks on the request limits (hardening, second round) --------------------------


def post(gw, path, body, key):
    """A raw POST to the gateway (JSON the openai client would not send), as an attacker sends it."""

    async def send():
        async with httpx.AsyncClient(timeout=60) as h:
            return await h.post(f"{gw.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"})

    return send()


def test_limits_hold_on_the_values_vllm_parses(loop, served):
    """vLLM's request models coerce "17", 17.0 and "10000" to ints: the limits hold on the values
    vLLM parses, not only on JSON ints."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        got = {}
        for name, extra in [
            ("n str", {"n": "17", "max_tokens": 2}),
            ("n float", {"n": 17.0, "max_tokens": 2}),
            ("max_tokens str", {"max_tokens": "10000"}),
            ("max_tokens float", {"max_tokens": 10000.0}),
            ("max_completion_tokens str", {"max_completion_tokens": "10000"}),
        ]:
            got[name] = await post(gw, "/chat/completions", {"model": MODEL_NAME, "messages": HI, **extra}, sid)
        got["prompts × n"] = await post(
            gw, "/completions", {"model": MODEL_NAME, "prompt": ["a", "b"], "n": "9", "max_tokens": 1}, sid
        )
        return got, await gw.finish(sid)

    got, record = loop.run_until_complete(main())
    for name, r in got.items():
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
    said = {name: r.json()["error"]["message"] for name, r in got.items()}
    assert said["n str"] == said["n float"] == "17 choices (n × prompts) exceed the gateway's max_n (16)"
    assert said["prompts × n"].startswith("18 choices")
    assert (
        said["max_tokens str"] == said["max_tokens float"] == "max_tokens=10000 exceeds the gateway's max_tokens (8192)"
    )
    assert said["max_completion_tokens str"].startswith("max_completion_tokens=10000 exceeds")
    assert record.turns == []


def test_a_request_without_max_tokens_gets_the_gateways_default(loop, served):
    """A chat request without max_tokens (or with null) would sample to the end of the context:
    it gets gateway.default_max_tokens. (A completions request gets OpenAI's 16 from vLLM.)"""
    gw, *_ = served
    saved = getattr(gw.cfg, "default_max_tokens", None)
    gw.cfg.default_max_tokens = 5

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        chat_ = await chat(c, HI, extra_body={"ignore_eos": True})
        body = {"model": MODEL_NAME, "messages": HI, "max_tokens": None, "max_completion_tokens": None}
        null = await post(gw, "/chat/completions", {**body, "ignore_eos": True}, sid)
        return chat_, null, await gw.finish(sid)

    try:
        chat_, null, record = loop.run_until_complete(main())
    finally:
        gw.cfg.default_max_tokens = saved
    assert chat_.usage.completion_tokens == 5, chat_.usage
    assert null.status_code == 200 and null.json()["usage"]["completion_tokens"] == 5, null.text[:300]
    assert [len(t.token_ids[0]) for t in record.turns] == [5, 5]
    gw.cfg.default_max_tokens = 1024  # past the context (512): vLLM would refuse it, so the context bounds it
    try:
        assert gw.default_max_tokens == 512
    finally:
        gw.cfg.default_max_tokens = saved


@pytest.mark.parametrize(
    "path,option",
    [
        ("/chat/completions", {"use_beam_search": True, "n": 2}),
        ("/completions", {"use_beam_search": "true", "n": 2}),
        ("/completions", {"best_of": 4}),
        ("/chat/completions", {"prompt_logprobs": 0}),
        ("/completions", {"echo": True, "logprobs": 1}),
        ("/chat/completions", {"echo": True, "logprobs": True, "top_logprobs": 5}),
        ("/chat/completions", {"vllm_xargs": {"k": 1}}),
        ("/chat/completions", {"kv_transfer_params": {"do_remote_prefill": True}}),
    ],
)
def test_options_forge_does_not_support_are_refused(loop, served, path, option):
    """Beam search (a generation per beam and step, each recorded), best_of, prompt logprobs
    (echo computes them too) and vLLM's disaggregation and extension fields are refused with a 400
    naming the field; nothing is generated or recorded."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        body = {"model": MODEL_NAME, "max_tokens": 2, **option}
        body.update({"messages": HI} if path == "/chat/completions" else {"prompt": "rev abc="})
        return await post(gw, path, body, sid), await gw.finish(sid)

    r, record = loop.run_until_complete(main())
    field_ = next(k for k in option if k not in ("n", "logprobs", "top_logprobs"))
    assert r.status_code == 400 and f"'{field_}'" in r.text and "not supported" in r.text, r.text[:300]
    assert record.turns == []


def test_turns_and_tokens_are_counted_per_generation(loop, served):
    """One completions request of several prompts is a generation (a turn) per prompt: max_turns
    holds on them, not on HTTP requests. The tokens a session records (prompts and samples) are
    bounded by max_session_tokens."""
    gw, *_ = served
    saved = gw.cfg.max_turns, getattr(gw.cfg, "max_session_tokens", None)

    async def main():
        sid = gw.open_session()
        gw.cfg.max_turns = 2
        many = await post(gw, "/completions", {"model": MODEL_NAME, "prompt": ["a", "b", "c"], "max_tokens": 1}, sid)
        record = await gw.finish(sid)
        gw.cfg.max_turns = saved[0]
        sid = gw.open_session()
        gw.cfg.max_session_tokens = 30
        c = client(gw, sid)
        first = await chat(c, HI, max_tokens=25, extra_body={"ignore_eos": True})
        try:
            await chat(c, HI, max_tokens=2)
            second = None
        except openai.APIStatusError as e:
            second = e
        return many, record, first, second, await gw.finish(sid)

    try:
        many, record, first, second, tokens = loop.run_until_complete(main())
    finally:
        gw.cfg.max_turns, gw.cfg.max_session_tokens = saved
    assert many.status_code == 429 and "max_turns" in many.text, (many.status_code, many.text[:300])
    assert len(record.turns) <= 2
    assert first.usage.completion_tokens == 25
    assert second is not None and second.status_code == 429 and "max_session_tokens" in str(second)
    assert len(tokens.turns) == 1


def test_an_empty_api_key_is_refused(tiny_model_dir, monkeypatch, capsys):
    """An unfilled secret (FORGE_API_KEY="") would pass the "a key beyond loopback" check, and
    then every request without a key would match it: an empty key is refused wherever one is given."""
    import services.gateway
    from forge.cli import main
    from services.schema import GatewayConfig

    for host in ("0.0.0.0", "127.0.0.1"):
        for key in ("", "  "):
            with pytest.raises(ValueError, match="'gateway.api_key' is empty"):
                GatewayConfig(host=host, sessions=False, api_key=key).validate()
    seen = []

    async def serve(model, cfg, generator_cfg, replicas):
        cfg.validate()
        seen.append(cfg)

    monkeypatch.setattr(services.gateway, "serve", serve)
    monkeypatch.setenv("FORGE_API_KEY", "")
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_model_dir), "--host", "0.0.0.0"])
    assert seen == [] and "FORGE_API_KEY" in capsys.readouterr().err


def test_every_scope_is_allow_listed(loop):
    """Websocket scopes would reach vLLM's app past the route allow-list (and its realtime
    routes, where installed): refused; only the server's own lifespan scope passes."""
    from services.gateway import _Gate

    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    gate = _Gate(app, gateway=None)
    for path in ("/v1/realtime", "/v1/chat/completions"):
        loop.run_until_complete(gate({"type": "websocket", "path": path, "headers": []}, receive, send))
    loop.run_until_complete(gate({"type": "lifespan"}, receive, send))
    assert reached == ["lifespan"]
    assert [m["type"] for m in sent] == ["websocket.close", "websocket.close"]


def test_odd_headers_and_bodies_get_answers_not_server_errors(loop, served):
    """A key with a byte that is not UTF-8 is a 401, a lower-case `bearer` scheme is a bearer, JSON
    nested past any parser's depth is a 400, and a chat request's extra `prompt` field counts for
    no choices."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        url, hi = f"{gw.base_url}/chat/completions", {"model": MODEL_NAME, "messages": HI, "max_tokens": 2}
        async with httpx.AsyncClient(timeout=60) as h:
            got = {
                "latin-1 key": await h.post(url, json=hi, headers={"Authorization": b"Bearer \xff" + sid.encode()}),
                "lower-case scheme": await h.post(url, json=hi, headers={"Authorization": f"bearer {sid}"}),
                "deep JSON": await h.post(
                    url, content=b"[" * 60000 + b"]" * 60000, headers={"Authorization": f"Bearer {sid}"}
                ),
                "extra prompt": await h.post(
                    url, json={**hi, "prompt": ["x"] * 20}, headers={"Authorization": f"Bearer {sid}"}
                ),
            }
        await gw.finish(sid)
        return got

    got = loop.run_until_complete(main())
    assert got["latin-1 key"].status_code == 401, got["latin-1 key"].text
    assert got["lower-case scheme"].status_code == 200, got["lower-case scheme"].text
    assert got["deep JSON"].status_code == 400 and "nested too deeply" in got["deep JSON"].text
    assert got["extra prompt"].status_code == 200, got["extra prompt"].text


def test_a_request_takes_its_place_in_the_limits_before_its_body_arrives(loop, served):
    """Requests whose bodies come slowly after their headers: only max_session_inflight of them
    pass, the rest get 429, and a finish while one is admitted waits for it and returns its turn."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        body = json.dumps({"model": MODEL_NAME, "messages": HI, "max_tokens": 2}).encode()

        async def slow_body():
            await asyncio.sleep(0.5)
            yield body

        saved = gw.cfg.max_session_inflight
        gw.cfg.max_session_inflight = 1
        try:
            async with httpx.AsyncClient(timeout=60) as h:
                sent = [
                    asyncio.ensure_future(
                        h.post(
                            f"{gw.base_url}/chat/completions",
                            content=slow_body(),
                            headers={"Authorization": f"Bearer {sid}", "Content-Type": "application/json"},
                        )
                    )
                    for _ in range(4)
                ]
                await asyncio.sleep(0.2)  # all admitted or refused; no body has arrived
                record = await gw.finish(sid)
                got = await asyncio.gather(*sent)
        finally:
            gw.cfg.max_session_inflight = saved
        print([r.text for r in got])
        return sorted(r.status_code for r in got), record

    statuses, record = loop.run_until_complete(main())
    assert statuses == [200, 429, 429, 429] and len(record.turns) == 1, (statuses, record.turns)


def test_finish_stops_the_calls_it_waits_no_longer_for(loop, served):
    """finish(timeout_s) with a long generation running: the generation is stopped in vLLM, and
    the record finish returned does not change after it."""
    gw, gen, *_ = served

    async def main():
        sid = gw.open_session()
        c = client(gw, sid)
        call = asyncio.ensure_future(chat(c, HI, max_tokens=400, extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.5)
        record = await gw.finish(sid, timeout_s=0.2)
        turns = len(record.turns)
        await asyncio.gather(call, return_exceptions=True)
        deadline = time.monotonic() + 10
        while await gen.unfinished_requests.route() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return turns, len(record.turns), await gen.unfinished_requests.route()

    at_finish, later, running = loop.run_until_complete(main())
    assert at_finish == later == 0 and running == 0


def test_a_stream_aborted_before_it_starts_generates_nothing(loop, served, tiny_model_dir):
    """The gateway's abort of a request its client left can reach the replica before the request
    does (vLLM does not know it yet, and its abort does nothing): the replica remembers it, and the
    request ends as it starts instead of sampling all its tokens for nobody."""
    from monarch.actor import Channel
    from vllm.sampling_params import SamplingParams

    gw, gen, *_ = served

    async def main():
        target = gen.pinned()
        await target.abort.route("left-early")
        port, receiver = Channel.open()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        call = asyncio.ensure_future(target.stream.route(port, {"prompt_token_ids": [1, 2, 3]}, params, "left-early"))
        got = []
        while (message := await receiver.recv()) is not None:
            got.append(message)
        await call
        return got

    assert loop.run_until_complete(main()) == ["start"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        {"messages": [{"role": "user", "content": "hi"}]},  # the default max_tokens goes in
        {"messages": [{"role": "user", "content": "hi"}], "n": 9, "max_tokens": 4},  # past max_n
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},  # past max_tokens
        {"messages": [{"role": "user", "content": "hi"}], "n": "9"},  # a count as vLLM's parse reads it
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4.0e6},
        {"messages": [{"role": "user", "content": "hi"}], "n": True},
        {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": "true"},
        {"messages": [{"role": "user", "content": "hi"}], "echo": False, "request_id": "mine"},
        {"messages": "not a list", "max_tokens": 4},  # vLLM names what is wrong
        {"prompt": ["a"] * 9},
        [1, 2],
    ],
)
def test_a_chat_request_read_as_sent_is_checked_as_the_parsed_one(body, monkeypatch):
    """A chat request whose fields need no parse is read as sent: each body gets what it gets
    when vLLM's request model parses it (the same limits, refusals and default max_tokens)."""
    from services import gateway
    from services.schema import GatewayConfig

    cfg, raw = GatewayConfig(max_n=4, max_tokens=1000), json.dumps(body).encode()
    read = gateway._checked_request(raw, "/v1/chat/completions", cfg, 64)
    parsed = []
    monkeypatch.setattr(
        gateway, "_as_parsed", lambda request, path: parsed.append(1) or gateway._parsed_fields(request, path)
    )
    assert gateway._checked_request(raw, "/v1/chat/completions", cfg, 64) == read
    assert parsed  # the comparison is with the parse


async def bounded_server(app: Any, deadline_s: float) -> tuple[Any, asyncio.Future, tuple]:
    """uvicorn serving the ASGI `app` on loopback with forge's HTTP bounds: the server, its task
    and its address."""
    import socket

    import uvicorn

    from forge.http_bounds import bounded_http

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http=bounded_http(deadline_s, 8))
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    return server, task, sock.getsockname()


def test_a_response_its_client_never_reads_is_cut_at_the_deadline(loop):
    """A client that sends a whole request and never reads the answer (a long stream) stalls the
    server's writes: within request_deadline_s of the stall its connection is dropped, so the
    request ends (its generation aborted, its place in the limits freed) instead of waiting on the
    client for as long as it keeps the connection open."""
    ended = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        gone = asyncio.ensure_future(receive())  # http.disconnect once the connection is lost
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not gone.done():
            await send({"type": "http.response.body", "body": b"x" * (1 << 20), "more_body": True})
        ended.append(time.monotonic())

    async def main():
        server, task, address = await bounded_server(app, 1.0)
        reader, writer = await asyncio.open_connection(*address)
        writer.transport.pause_reading()  # never reads a byte of the answer
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        while not ended and time.monotonic() - start < 6:
            await asyncio.sleep(0.05)
        writer.close()
        server.should_exit = True
        await task
        return ended and ended[0] - start

    took = loop.run_until_complete(main())
    assert took and took < 4, took


def test_a_request_that_reaches_vllm_after_finish_generates_nothing(loop, served):
    """A request admitted before finish whose generation would start after it (its body was still
    on the way when finish gave up waiting): refused as the session's key is from then on, not
    sampled to its max_tokens for a record that will never take it."""
    gw, gen, *_ = served

    async def main():
        sid = gw.open_session()
        body = json.dumps({"model": MODEL_NAME, "messages": HI, "max_tokens": 400, "ignore_eos": True}).encode()

        async def slow_body():
            await asyncio.sleep(1.0)
            yield body

        async with httpx.AsyncClient(timeout=60) as h:
            sent = asyncio.ensure_future(
                h.post(
                    f"{gw.base_url}/chat/completions",
                    content=slow_body(),
                    headers={"Authorization": f"Bearer {sid}", "Content-Type": "application/json"},
                )
            )
            await asyncio.sleep(0.3)  # admitted, its body on the way
            record = await gw.finish(sid, timeout_s=0.2)
            r = await sent
        return r, record

    r, record = loop.run_until_complete(main())
    assert r.status_code == 401 and "finished" in r.json()["error"]["message"], (r.status_code, r.text[:300])
    assert record.turns == []


def test_logprob_options_are_answered_as_asked_or_refused_by_name(loop, served):
    """The gateway asks vLLM for the sampled token's logprob when the client asks for none; it
    does not rewrite what a client asked: top_logprobs=-1 (vLLM's whole vocabulary) is refused past
    max_logprobs as vLLM's own server refuses it, not answered with one; `logprob_token_ids` is
    refused naming the field, not with an error about a `logprobs=0` the client never sent."""
    gw, *_ = served

    async def main():
        sid = gw.open_session()
        chat_ = {"model": MODEL_NAME, "messages": HI, "max_tokens": 2, "logprobs": True}
        got = {
            "top_logprobs -1": await post(gw, "/chat/completions", {**chat_, "top_logprobs": -1}, sid),
            "logprobs -1": await post(
                gw, "/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "logprobs": -1}, sid
            ),
            "logprob_token_ids": await post(gw, "/chat/completions", {**chat_, "logprob_token_ids": [5, 6]}, sid),
        }
        return got, await gw.finish(sid)

    got, record = loop.run_until_complete(main())
    for name in ("top_logprobs -1", "logprobs -1"):
        assert got[name].status_code == 400 and "logprobs" in got[name].text, (name, got[name].text[:300])
    r = got["logprob_token_ids"]
    said = r.json()["error"]["message"]
    assert r.status_code == 400 and "'logprob_token_ids' is not supported" in said and "=0" not in said, said
    assert record.turns == []


def test_a_body_vllms_request_model_refuses_is_a_400_naming_the_field(loop, served):
    """vLLM's request models refuse some bodies in validators of their own (an empty prompt, a
    negative top_logprobs) or choke on a wrong JSON type there, errors pydantic does not wrap:
    the limits' parse of such a body is a JSON 400, not a plain-text 500 (which the openai client
    retries); vLLM's own refusals name the field."""
    gw, *_ = served
    chat_ = {"model": MODEL_NAME, "messages": HI, "n": "2", "max_tokens": 2}  # n "2": the limits parse it

    async def main():
        sid = gw.open_session()
        got = {
            "prompt": await post(gw, "/completions", {"model": MODEL_NAME, "prompt": "", "max_tokens": 2}, sid),
            "top_logprobs": await post(gw, "/chat/completions", {**chat_, "logprobs": True, "top_logprobs": -5}, sid),
            "messages": await post(gw, "/chat/completions", {**chat_, "messages": -5}, sid),
            "structured_outputs": await post(
                gw, "/completions", {"model": MODEL_NAME, "prompt": "hi", "structured_outputs": "x"}, sid
            ),
        }
        return got, await gw.finish(sid)

    got, record = loop.run_until_complete(main())
    for name, r in got.items():
        assert r.status_code == 400 and r.json()["error"]["message"], (name, r.status_code, r.text[:300])
    for name in ("prompt", "top_logprobs"):
        assert name in got[name].json()["error"]["message"], got[name].text[:300]
    assert record.turns == []


def test_a_pipelined_request_that_arrived_whole_is_not_cut_while_it_is_answered(loop):
    """Two requests sent in one write (HTTP/1.1 pipelining): the second has arrived whole when the
    first's response ends, so request_deadline_s does not run on while it is answered; a second
    that takes longer than the deadline still gets its answer."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/slow":
            await asyncio.sleep(1.5)  # longer than the deadline
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        server, task, address = await bounded_server(app, 0.5)
        reader, writer = await asyncio.open_connection(*address)
        writer.write(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        try:
            while got.count(b"ok") < 2:
                chunk = await asyncio.wait_for(reader.read(4096), 5)
                if not chunk:
                    break
                got += chunk
        finally:
            writer.close()
            server.should_exit = True
            await task
        return got

    got = loop.run_until_complete(main())
    assert got.count(b"HTTP/1.1 200") == 2, got
