"""The Tinker API's front door over stand-in trainer and generator services (each endpoint can be
made slow or to fail): what it does when a service call fails, a session closes mid-request,
requests race, or a client sends what no SDK would. Its HTTP server listens on 127.0.0.1 only.
(tests/test_tinker.py runs the real services under the SDK.)"""

import asyncio
import json
import socket
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from tinker import TrainingClient, types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_sample_response

from forge.schema import LoRAConfig
from forge.types import Completion
from services.schema import TinkerConfig
from services.tinker import TinkerFront
from services.tinker_wire import encode_sample

PROTO = {"content-type": "application/x-protobuf"}
VOCAB = 100


class Endpoint:
    def __init__(self, service: "Stand", name: str):
        self.service, self.name = service, name

    async def route(self, *args, **kwargs):
        return await self.service.call(self.name, *args)

    async def fanout(self, *args, **kwargs):
        return [await self.service.call(self.name, *args)]


class Stand:
    """A service stand-in: `delay[name]` seconds per call, `fail[name]` raised; it keeps the
    tenants and LoRA policies made and not removed, and what forward_backward was given."""

    def __init__(self):
        self.delay, self.fail = {}, {}
        self.tenants, self.policies, self.batches = set(), set(), []
        self.peak_policies = 0

    def set_restore_point(self, point):
        self.restore = point

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return Endpoint(self, name)

    async def call(self, name, *args):
        await asyncio.sleep(self.delay.get(name, 0))
        if name in self.fail:
            raise self.fail[name]
        if name in ("add_tenant", "remove_tenant"):
            (self.tenants.add if name == "add_tenant" else self.tenants.discard)(args[0])
        elif name in ("add_policy", "remove_policy"):
            if name == "add_policy" and args[0] in self.policies:
                raise ValueError(f"policy {args[0]!r} exists")
            (self.policies.add if name == "add_policy" else self.policies.discard)(args[0])
            self.peak_policies = max(self.peak_policies, len(self.policies))
        elif name == "tenant_adapter":
            key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
            return {key: torch.zeros(4, 8)}, LoRAConfig(rank=4, alpha=8, targets=["q_proj"])
        elif name == "forward_backward":
            datums = args[1]
            self.batches.append(tuple(datums.input_ids.shape))
            return [[float(n)] * n for n in datums.lengths], 1.0  # a row's "logprobs": its length, per token
        elif name == "optim_step":
            return {"grad_norm": 0.0}
        return None


@pytest.fixture
def front(loop, tmp_path):
    """(front, trainer, generator, an httpx client's factory) on a fresh server; `cfg` overrides."""
    made = []

    def make(**cfg):
        trainer, gen = Stand(), Stand()
        f = TinkerFront(trainer, gen, tmp_path, TinkerConfig(port=0, **cfg), tmp_path / "run", VOCAB, 64)
        made.append(f)
        return f, trainer, gen

    yield make
    for f in made:
        if f._server is not None:
            loop.run_until_complete(f.shutdown())


def client(front: TinkerFront) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"{front.base_url}/api/v1", timeout=30)


async def session(c: httpx.AsyncClient) -> str:
    return (await c.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"})).json()[
        "session_id"
    ]


async def create(c: httpx.AsyncClient, front: TinkerFront, sid: str, seq: int = 0) -> httpx.Response:
    body = {"session_id": sid, "model_seq_id": seq, "base_model": front.base_model, "lora_config": {"rank": 4}}
    return await c.post("/create_model", json=body)


async def new_model(c: httpx.AsyncClient, front: TinkerFront) -> tuple[str, dict]:
    """A new session and its first model, made: (the session's id, the create's answer)."""
    sid = await session(c)
    made = (await create(c, front, sid)).json()
    await wait(c, made["request_id"])
    return sid, made


async def wait(c: httpx.AsyncClient, rid: str):
    for _ in range(100):
        r = await c.post("/retrieve_future", json={"request_id": rid})
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return r.content
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"{rid} never finished")


def fwdbwd(model_id: str, seq: int, lengths: list[int]) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    for n in lengths:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.full(n, 1, "<i4").tobytes()
        targets = pb.Tensor(dense=np.full(n, 5, "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n])
        d.loss_fn_inputs["target_tokens"].CopyFrom(targets)
        weights = pb.Tensor(dense=np.ones(n, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[n])
        d.loss_fn_inputs["weights"].CopyFrom(weights)
    return msg.SerializeToString()


def logprob_rows(result: bytes) -> list[list[float]]:
    record = pb.ForwardBackwardOutput.FromString(result).loss_fn_outputs[0].fields["logprobs"]
    data, offsets = np.frombuffer(record.data, "<f4"), np.frombuffer(record.offsets, "<i8") // 4
    return [data[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def serve(loop, make, **cfg):
    f, trainer, gen = make(**cfg)
    loop.run_until_complete(f.serve())
    return f, trainer, gen


def test_a_create_refused_for_a_full_session_holds_no_model_and_its_retry_is_made(loop, front):
    """The SDK retries a 429 with the same model_seq_id: the refused create registered nothing
    (no model, no slot of max_models), so the retry, once the session has room, makes it."""
    f, trainer, _ = serve(loop, front, max_inflight_per_session=2, max_models=2)

    async def scenario():
        async with client(f) as c:
            sid = await session(c)
            first = (await create(c, f, sid, 0)).json()
            await wait(c, first["request_id"])
            trainer.delay["forward_backward"] = 0.5
            busy = [
                (await c.post("/forward_backward", content=fwdbwd(first["model_id"], s, [3]), headers=PROTO))
                for s in (1, 2)
            ]
            refused = await create(c, f, sid, 1)
            models_then = sorted(f.models)
            for r in busy:
                await wait(c, r.json()["request_id"])
            retried = await create(c, f, sid, 1)
            return refused, models_then, retried, await wait(c, retried.json()["request_id"])

    refused, models_then, retried, made = loop.run_until_complete(scenario())
    assert refused.status_code == 429 and "max_inflight_per_session" in refused.text, refused.text
    assert len(models_then) == 1, models_then
    assert retried.status_code == 200 and made["model_id"].endswith(":train:1"), (retried.text, made)
    assert len(trainer.tenants) == 2


def test_a_model_not_made_fails_its_queued_requests_and_leaves_no_task(loop, front):
    """The trainer fails to make a model's tenant: the requests queued behind it fail too, with
    why, instead of waiting forever (each holding a slot of the session's in-flight budget)."""
    f, trainer, _ = serve(loop, front, poll_s=1.0)
    trainer.delay["add_tenant"] = 0.3
    trainer.fail["add_tenant"] = RuntimeError("trainer: out of memory")

    async def scenario():
        async with client(f) as c:
            sid = await session(c)
            made = (await create(c, f, sid)).json()
            queued = await c.post("/forward_backward", content=fwdbwd(made["model_id"], 1, [3]), headers=PROTO)
            answers = await wait(c, made["request_id"]), await wait(c, queued.json()["request_id"])
            await asyncio.sleep(0.1)
            return answers, [t.get_coro().__qualname__ for t in f._tasks]

    (made, queued), tasks = loop.run_until_complete(scenario())
    assert made["category"] == "server" and "out of memory" in made["error"], made
    assert "was not made" in queued["error"] and "out of memory" in queued["error"], queued
    assert tasks == ["TinkerFront._reap"], tasks


def test_a_session_closed_while_its_model_or_sampler_loads_leaves_neither(loop, front):
    """The session finishes while its model's tenant is being made, and while a sampler's adapter
    is on its way to the generators: neither stays on its service, nor in the generators'
    restore point."""
    f, trainer, gen = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            sid, made = await new_model(c, f)
            gen.delay["load_weights"] = 0.4
            body = {"model_id": made["model_id"], "sampling_session_seq_id": 0, "seq_id": 1}
            sampler = (await c.post("/save_weights_for_sampler", json=body)).json()
            trainer.delay["add_tenant"] = 0.4
            second = (await create(c, f, sid, 1)).json()
            await asyncio.sleep(0.2)  # both on their way
            await c.post(f"/sessions/{sid}/finish")
            await asyncio.sleep(0.6)
            return sampler, second

    loop.run_until_complete(scenario())
    assert trainer.tenants == set() and gen.policies == set() and f.adapters == {} and f.samplers == {}


def test_a_sessions_sampler_cap_holds_against_requests_at_once(loop, front):
    """Many create_sampling_session requests of one session at once (and a retry of one while it
    loads): at most max_samplers_per_session adapters of it are ever on the generators, and the
    retry gets the same sampler."""
    f, _, gen = serve(loop, front, max_samplers_per_session=3)

    async def scenario():
        async with client(f) as c:
            sid, made = await new_model(c, f)
            saved = (
                await c.post("/save_weights_for_sampler", json={"model_id": made["model_id"], "path": "s", "seq_id": 1})
            ).json()
            path = (await wait(c, saved["request_id"]))["path"]
            gen.delay["load_weights"] = 0.05
            bodies = [{"session_id": sid, "sampling_session_seq_id": i % 20, "model_path": path} for i in range(40)]
            return await asyncio.gather(*(c.post("/create_sampling_session", json=b) for b in bodies))

    answers = loop.run_until_complete(scenario())
    assert {r.status_code for r in answers} == {200}, {r.text for r in answers if r.status_code != 200}
    assert gen.peak_policies <= 3 and len(gen.policies) == 3, (gen.peak_policies, gen.policies)


def test_datums_of_mixed_lengths_are_padded_by_length_class(loop, front):
    """One long datum among many short ones: the trainer gets each length class padded to its
    own longest (at most twice the request's tokens in cells, not rows x the longest), and the
    logprobs come back in the request's order."""
    f, trainer, _ = serve(loop, front, max_seq_len=64)
    lengths = [60] + [3] * 50 + [17, 2, 33]

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            handle = await c.post("/forward_backward", content=fwdbwd(made["model_id"], 1, lengths), headers=PROTO)
            return await wait(c, handle.json()["request_id"])

    rows = logprob_rows(loop.run_until_complete(scenario()))
    assert [len(r) for r in rows] == lengths and [r[0] for r in rows] == lengths
    cells = sum(n * width for n, width in trainer.batches)
    assert sum(n for n, _ in trainer.batches) == len(lengths) and cells <= 2 * sum(lengths), trainer.batches


@pytest.mark.parametrize(
    "method, path, body, named",
    [
        ("post", "/weights_info", b"[]", "tinker_path"),
        ("post", "/weights_info", b'{"tinker_path": 5}', "tinker_path"),
        ("get", "/checkpoints?limit=x", None, "limit"),
        ("get", "/checkpoints?offset=-5", None, "offset"),
        ("post", "/weights_info", b"{", "tinker_path"),
        ("post", "/weights_info", b"\xff", "tinker_path"),
        ("get", "/checkpoints?limit=%C2%B2", None, "limit"),  # '²': a digit to str.isdigit, not to int()
        ("get", "/checkpoints?offset=" + "9" * 5000, None, "offset"),
    ],
)
def test_malformed_fields_are_400s_naming_them(loop, front, method, path, body, named):
    f, *_ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            return await (c.get(path) if method == "get" else c.post(path, content=body))

    r = loop.run_until_complete(scenario())
    assert r.status_code == 400 and named in r.json()["detail"], r.text


def test_odd_values_are_refused_before_they_reach_a_service_or_the_disk(loop, front):
    """A base_model longer than a path may be, a ttl whose expiry is no date (or negative), a
    seed or stop token no engine takes: each a 400 naming the field; nothing half-saved."""
    f, *_ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            sid, made = await new_model(c, f)
            long_base = {"session_id": sid, "model_seq_id": 1, "base_model": "a" * 5000, "lora_config": {"rank": 4}}
            out = {"base_model": await c.post("/create_model", json=long_base)}
            for i, ttl in enumerate((10**308, -1)):
                body = {"model_id": made["model_id"], "path": f"x{i}", "seq_id": 1, "ttl_seconds": ttl}
                out[f"ttl {ttl}"] = await c.post("/save_weights", json=body)
            out["listing"] = await c.get("/checkpoints")
            await c.post("/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0})
            prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
            for name, params in (("seed", {"seed": 2**70}), ("stop", {"stop": [VOCAB + 5]})):
                body = {"sampling_session_id": f"{sid}:sample:0", "prompt": prompt, "num_samples": 1}
                out[name] = await c.post("/asample", json={**body, "sampling_params": {"max_tokens": 4, **params}})
            return out, sorted(p.name for p in (f.root / made["model_id"] / "weights").glob("*"))

    out, saved = loop.run_until_complete(scenario())
    for what, named in (
        ("base_model", "base_model"),
        ("ttl 10", "ttl_seconds"),
        ("ttl -1", "ttl_seconds"),
        ("seed", "sampling_params.seed"),
        ("stop", "sampling_params.stop"),
    ):
        (r,) = [v for k, v in out.items() if k.startswith(what)]
        assert r.status_code == 400 and named in r.json()["detail"], (what, r.text)
    assert out["listing"].status_code == 200 and saved == [], (out["listing"].text, saved)


def test_overwrite_false_holds_for_saves_queued_together(loop, front):
    """Two saves to one name, both submitted before either ran: the second is refused when it
    runs (the name exists by then), not written over the first."""
    f, trainer, _ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            trainer.delay["forward_backward"] = 0.3  # the saves wait behind it
            await c.post("/forward_backward", content=fwdbwd(made["model_id"], 1, [3]), headers=PROTO)
            handles = [
                await c.post("/save_weights", json={"model_id": made["model_id"], "path": "x", "seq_id": s})
                for s in (2, 3)
            ]
            return [await wait(c, h.json()["request_id"]) for h in handles]

    first, second = loop.run_until_complete(scenario())
    assert first["path"].endswith("/weights/x") and "exists" in second["error"], (first, second)


def test_connections_that_never_send_a_whole_request_are_closed(loop, front):
    """Before any key is checked: connections that send nothing, half a head or half a body are
    closed at the request deadline; past max_connections, new ones are closed at once; a whole
    request is still served."""
    f, *_ = serve(loop, front, api_keys=["tml-" + "a" * 28], request_deadline_s=1.0, max_connections=12)
    port = int(f.base_url.rsplit(":", 1)[1])
    partial = [
        b"",
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\n",
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
    ]

    def closed(s: socket.socket) -> bool:  # what the server answered read, then: did it close?
        try:
            while s.recv(4096):
                pass
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True

    async def scenario():
        socks = []
        for i in range(12):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(partial[i % 3])
            s.setblocking(False)
            socks.append(s)
        await asyncio.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.setblocking(False)
        await asyncio.sleep(0.3)
        over = closed(extra)
        before = sum(closed(s) for s in socks)
        await asyncio.sleep(1.5)
        after = sum(closed(s) for s in socks)
        for s in [*socks, extra]:
            s.close()
        async with httpx.AsyncClient(base_url=f"{f.base_url}/api/v1", headers={"X-API-Key": "tml-" + "a" * 28}) as c:
            served = await c.get("/healthz")
        return over, before, after, served.status_code

    t = time.monotonic()
    over, before, after, served = loop.run_until_complete(scenario())
    assert over and before == 0 and after == 12 and served == 200, (over, before, after, served)
    assert time.monotonic() - t < 10


def test_a_non_finite_grad_norm_reaches_the_sdk(loop, front):
    """A diverged step (its gradient norm inf or NaN) is still a result: retrieve_future answers
    it, and the SDK's parser (orjson, then OptimStepResponse) reads the same number back, not a
    500 the SDK would retry until it gives up."""
    import orjson
    from tinker import types

    f, trainer, _ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            out = []
            for seq, norm in ((1, float("inf")), (2, float("nan"))):
                trainer.call = _returning(Stand.call.__get__(trainer), "optim_step", {"grad_norm": norm})
                body = {"model_id": made["model_id"], "seq_id": seq, "adam_params": {"learning_rate": 0.1}}
                rid = (await c.post("/optim_step", json=body)).json()["request_id"]
                out.append(await c.post("/retrieve_future", json={"request_id": rid}))
            return out

    inf, nan = loop.run_until_complete(scenario())
    for r in (inf, nan):
        assert r.status_code == 200, r.text
    got = [
        types.OptimStepResponse.model_validate(orjson.loads(r.content)).metrics["grad_norm:mean"] for r in (inf, nan)
    ]
    assert got[0] == float("inf") and got[1] != got[1], got


def _returning(call, name, value, calls=None):
    """`call` (a Stand's), but `name` returns `value` (its calls' args appended to `calls`)."""

    async def patched(what, *args):
        if what != name:
            return await call(what, *args)
        if calls is not None:
            calls.append(args)
        return value

    return patched


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_loss_fn_config_is_a_400_naming_it(loop, front, value):
    """A ppo clip threshold of NaN or an infinity would make the loss (and every gradient of the
    adapter) NaN: refused, naming the key, before it reaches the trainer."""
    f, trainer, _ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            msg = pb.ForwardBackwardRequest(model_id=made["model_id"], seq_id=1, loss_fn="ppo")
            d = msg.data.add()
            d.model_input.add().encoded_text.tokens = np.full(3, 1, "<i4").tobytes()
            d.loss_fn_inputs["target_tokens"].CopyFrom(
                pb.Tensor(dense=np.full(3, 5, "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[3])
            )
            for name in ("logprobs", "advantages"):
                d.loss_fn_inputs[name].CopyFrom(
                    pb.Tensor(dense=np.zeros(3, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[3])
                )
            msg.loss_fn_config["clip_low_threshold"] = value
            return await c.post("/forward_backward", content=msg.SerializeToString(), headers=PROTO)

    r = loop.run_until_complete(scenario())
    assert r.status_code == 400 and "clip_low_threshold" in r.json()["detail"], r.text
    assert trainer.batches == []


def test_a_checkpoint_of_another_base_model_is_named_and_not_loaded(loop, front):
    """The run directory outlives the server: one restarted on another base model finds the old
    checkpoints. weights_info names each one's own base model (what the SDK creates the training
    client from), and loading one onto this model is refused, naming both, instead of an
    adapter trained for another model silently loaded onto this one."""
    old, *_ = serve(loop, front)

    async def save():
        async with client(old) as c:
            _, made = await new_model(c, old)
            out = []
            for seq, (path, kind) in enumerate((("w", "save_weights"), ("s", "save_weights_for_sampler")), 1):
                h = await c.post(f"/{kind}", json={"model_id": made["model_id"], "path": path, "seq_id": seq})
                out.append((await wait(c, h.json()["request_id"]))["path"])
            return out

    weights, sampler = loop.run_until_complete(save())
    new, trainer, gen = serve(loop, front, base_model="another-model")

    async def load():
        async with client(new) as c:
            sid = await session(c)
            info = await c.post("/weights_info", json={"tinker_path": weights})
            body = {"session_id": sid, "model_seq_id": 0, "path": weights, "optimizer": False}
            loaded = await c.post("/load_weights", json=body)
            body = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": sampler}
            return info, loaded, await c.post("/create_sampling_session", json=body)

    info, loaded, sampling = loop.run_until_complete(load())
    assert info.status_code == 200 and info.json()["base_model"] == old.base_model, info.text
    for r in (loaded, sampling):
        assert r.status_code == 400 and "another-model" in r.json()["detail"], r.text
        assert old.base_model in r.json()["detail"], r.text
    assert trainer.tenants == set() and gen.policies == set()


def test_an_unreadable_checkpoint_leaves_the_listings_of_the_rest(loop, front):
    """A checkpoint's metadata cut short (the server killed while it wrote it) or gone while the
    listing reads it (its ttl passed): the listing still answers with every other checkpoint."""
    f, *_ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            h = await c.post("/save_weights", json={"model_id": made["model_id"], "path": "ok", "seq_id": 1})
            path = (await wait(c, h.json()["request_id"]))["path"]
            broken = f.root / "sess-x:train:0" / "weights" / "cut"
            broken.mkdir(parents=True)
            (broken / "forge_tinker.json").write_text('{"owner": "lo')
            return path, await c.get("/checkpoints"), await c.get(f"/training_runs/{made['model_id']}/checkpoints")

    path, listed, run = loop.run_until_complete(scenario())
    assert listed.status_code == 200, listed.text
    assert [c["tinker_path"] for c in listed.json()["checkpoints"]] == [path]
    assert run.status_code == 200 and len(run.json()["checkpoints"]) == 1, run.text


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_lora_seed_no_generator_takes_is_a_400_naming_it(loop, front, seed):
    """lora_config.seed seeds a torch generator (a 64-bit integer): one beyond that is refused,
    naming the field, as a sample's seed is; no tenant is made."""
    f, trainer, _ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            sid = await session(c)
            body = {"session_id": sid, "model_seq_id": 0, "base_model": f.base_model}
            return await c.post("/create_model", json={**body, "lora_config": {"rank": 4, "seed": seed}})

    r = loop.run_until_complete(scenario())
    assert r.status_code == 400 and "lora_config.seed" in r.json()["detail"], r.text
    assert f.models == {} and trainer.tenants == set()


def test_a_datum_of_millions_of_empty_chunks_is_refused_at_once(loop, front):
    """16 MB of empty model_input chunks (four million) in one datum: refused before they are
    walked one by one, which held the event loop, every client's requests with it, for seconds."""
    f, trainer, _ = serve(loop, front)
    msg = pb.ForwardBackwardRequest.FromString(fwdbwd("m", 1, [3]))
    empty = pb.Datum()
    empty.model_input.add().encoded_text.SetInParent()
    msg.data[0].MergeFromString(empty.SerializeToString() * 4_000_000)  # appended to its chunks
    body = msg.SerializeToString()

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            msg.model_id = made["model_id"]
            return await c.post("/forward_backward", content=msg.SerializeToString(), headers=PROTO)

    r = loop.run_until_complete(scenario())
    assert len(body) < 16 << 20 and r.status_code == 400 and "model_input" in r.json()["detail"], r.text
    assert "chunks" in r.json()["detail"], r.text
    assert trainer.batches == []


def test_a_json_body_larger_than_any_prompt_is_refused_unparsed(loop, front):
    """A sample request of 12 MB (six million prompt tokens; a prompt holds at most max_model_len,
    64 here): a 413 before the SDK's types parse it, which held the event loop, every client's
    requests with it, for seconds. A forward_backward (protobuf) still takes max_request_bytes."""
    f, *_ = serve(loop, front)
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1] * 6_000_000}]}
    params = {"sampling_session_id": "x", "num_samples": 1, "sampling_params": {"max_tokens": 3}}
    body = json.dumps({**params, "prompt": prompt}).encode()

    async def scenario():
        async with client(f) as c:
            sent = await c.post("/asample", content=body)
            big = await c.post("/forward_backward", content=fwdbwd("m", 1, [64] * 1000), headers=PROTO)
            return sent, big

    r, big = loop.run_until_complete(scenario())
    assert r.status_code == 413 and "bytes" in r.json()["detail"], r.text
    assert big.status_code == 400 and "no model" in big.json()["detail"], big.text  # read and decoded


def test_a_save_that_fails_leaves_no_half_checkpoint_and_loses_none(loop, front):
    """The trainer fails to write a checkpoint (a full disk): the request fails, nothing of it stays
    on disk to hold its name (the same save, tried again, is made), and a checkpoint it was to
    overwrite is still there, whole."""
    f, trainer, _ = serve(loop, front)

    async def save(c, model_id: str, seq: int, name: str, overwrite: bool = False):
        body = {"model_id": model_id, "path": name, "seq_id": seq, "overwrite": overwrite}
        r = (await c.post("/save_weights", json=body)).json()
        return await wait(c, r["request_id"]) if "request_id" in r else r

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            kept = (await save(c, made["model_id"], 1, "kept"))["path"]
            trainer.fail["save_tenant"] = OSError("No space left on device")
            failed = [await save(c, made["model_id"], 2, "ckpt"), await save(c, made["model_id"], 3, "kept", True)]
            left = sorted(p.name for p in (f.root / made["model_id"] / "weights").iterdir())
            del trainer.fail["save_tenant"]
            info = await c.post("/weights_info", json={"tinker_path": kept})
            return failed, left, info, await save(c, made["model_id"], 4, "ckpt")

    failed, left, info, again = loop.run_until_complete(scenario())
    assert all("No space left" in r["error"] for r in failed) and left == ["kept"], (failed, left)
    assert info.status_code == 200, info.text
    assert again.get("path", "").endswith("/weights/ckpt"), again


@pytest.mark.parametrize("field, value", [("grad_clip_norm", -1.0), ("weight_decay", -0.1)])
def test_a_negative_clip_norm_or_weight_decay_is_a_400_naming_it(loop, front, field, value):
    """A negative grad_clip_norm scales the gradients by a negative factor (the step climbs the
    loss) and a negative weight_decay grows the weights: refused, naming the field, not stepped."""
    f, trainer, _ = serve(loop, front)
    steps = []
    trainer.call = _returning(Stand.call.__get__(trainer), "optim_step", {"grad_norm": 1.0}, steps)

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            adam = {"learning_rate": 0.1, field: value}
            return await c.post("/optim_step", json={"model_id": made["model_id"], "seq_id": 1, "adam_params": adam})

    r = loop.run_until_complete(scenario())
    assert r.status_code == 400 and f"adam_params.{field}" in r.json()["detail"], r.text
    assert steps == []


@pytest.mark.parametrize("last_n", [2, 0, 9])
def test_prompt_logprobs_last_n_also_blanks_the_earlier_top_k(last_n):
    """`prompt_logprobs_last_n` scores the last N prompt tokens only, its top-k too (the SDK's
    SampleRequest): the positions before them are None in both (0: all of them)."""
    prompt = [3, 4, 5, 6, 7]
    found = [None] + [{t: -1.0, 9: -0.5} for t in prompt[1:]]
    done = Completion(prompt, [8], [-0.1], "", "stop", prompt_logprobs=found)
    req = types.SampleRequest(
        prompt=types.ModelInput.from_ints(prompt),
        sampling_params=types.SamplingParams(max_tokens=1),
        prompt_logprobs=True,
        topk_prompt_logprobs=2,
        prompt_logprobs_last_n=last_n,
    )
    out = deserialize_sample_response(encode_sample([done], req))
    kept = min(last_n, 4)  # the first prompt token has none
    assert out.prompt_logprobs == [None] * (5 - kept) + [-1.0] * kept
    assert out.topk_prompt_logprobs[: 5 - kept] == [None] * (5 - kept)
    assert out.topk_prompt_logprobs[5 - kept :] == [[(9, -0.5), (t, -1.0)] for t in prompt[5 - kept :]]


def test_a_model_loaded_from_a_checkpoint_with_another_optimizer_is_a_400_naming_it(loop, front):
    """create_training_client_from_state(path, optimizer=DimuonOptimizerConfig()): forge trains
    with AdamW only, so the optimizer the client asks for is refused, as create_model refuses it,
    and no model is made."""
    f, trainer, _ = serve(loop, front)

    async def go():
        async with client(f) as c:
            _, made = await new_model(c, f)
            h = await c.post("/save_weights", json={"model_id": made["model_id"], "path": "w", "seq_id": 1})
            path = (await wait(c, h.json()["request_id"]))["path"]
            sid = await session(c)
            body = {"session_id": sid, "model_seq_id": 0, "path": path, "optimizer": False}
            return await c.post("/load_weights", json={**body, "optimizer_config": {"type": "dimuon", "version": 1}})

    r = loop.run_until_complete(go())
    assert r.status_code == 400 and "optimizer_config" in r.json()["detail"] and "dimuon" in r.json()["detail"], r.text
    assert len(trainer.tenants) == 1


def test_the_sdk_cuts_a_large_forward_backward_into_chunks_the_server_takes(loop, front):
    """A forward_backward of more tokens than tinker.max_tokens (an RL batch: 1024 datums of 300
    tokens): the SDK cuts it by client/config's byte budget, and each of its chunks is taken."""
    f, trainer, _ = serve(loop, front)

    async def go():
        async with client(f) as c:
            cfg = types.ClientConfigResponse.model_validate((await c.post("/client/config", json={})).json())
            _, made = await new_model(c, f)
            data = [
                types.Datum(
                    model_input=types.ModelInput.from_ints([1] * 300),
                    loss_fn_inputs={"target_tokens": [5] * 300, "weights": [1.0] * 300},
                )
                for _ in range(1024)
            ]
            sdk = SimpleNamespace(holder=SimpleNamespace(_client_config=cfg))
            chunks = list(TrainingClient._chunked_requests_generator(sdk, data))
            out = []
            for seq, chunk in enumerate(chunks, 1):
                fb = types.ForwardBackwardInput(data=chunk.data, loss_fn="cross_entropy")
                req = types.ForwardBackwardRequest(forward_backward_input=fb, model_id=made["model_id"], seq_id=seq)
                body = forward_backward_request_to_proto(req).SerializeToString()
                out.append(await c.post("/forward_backward", content=body, headers=PROTO))
            return out

    answers = loop.run_until_complete(go())
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200][:1]


def test_an_endpoint_forge_does_not_serve_is_named(loop, front):
    """The SDK's calls forge does not serve (save_weights_external, RestClient.unpublish_checkpoint, ...)
    answer an error naming the call, not a bare "Not Found" a user reads as a missing checkpoint;
    without a key, a 401 as everywhere."""
    f, *_ = serve(loop, front, api_keys=["tml-a"])

    async def go():
        async with client(f) as c:
            gone = await c.delete("/training_runs/m/checkpoints/weights/w/publish", headers={"X-API-Key": "tml-a"})
            run = await c.post("/save_weights_external", json={"model_id": "m"}, headers={"X-API-Key": "tml-a"})
            return gone, run, await c.get("/training_runs/m")

    gone, run, anonymous = loop.run_until_complete(go())
    assert gone.status_code == 404, gone.text
    assert "DELETE /api/v1/training_runs/m/checkpoints/weights/w/publish" in gone.text, gone.text
    assert run.status_code == 404 and "not served" in run.text, run.text
    assert anonymous.status_code == 401, anonymous.text


def test_bodies_being_read_at_once_are_bounded_server_wide(loop, front):
    """Many clients each sending a body of up to max_request_bytes at once (1,024 connections of
    16 MiB: 16 GiB) are bounded together: past `max_body_bytes_in_flight` a request gets a 503
    naming it (the SDK retries), before its body is held; the others go on."""
    f, *_ = serve(loop, front, max_request_bytes=1 << 20, max_body_bytes_in_flight=1 << 20)
    gate = asyncio.Event()

    async def body():
        yield b"\0" * (600 << 10)
        await gate.wait()
        yield b"\0"

    async def scenario():
        async with client(f) as c, client(f) as other:
            posts = [
                asyncio.ensure_future(x.post("/forward_backward", content=body(), headers=PROTO)) for x in (c, other)
            ]
            await asyncio.sleep(2)  # both bodies' first 600 KiB sent
            gate.set()
            return await asyncio.gather(*posts, return_exceptions=True)

    answers = loop.run_until_complete(scenario())
    statuses = sorted(getattr(a, "status_code", None) or 0 for a in answers)
    refused = [a for a in answers if getattr(a, "status_code", None) == 503]
    assert len(refused) == 1 and "tinker.max_body_bytes_in_flight" in refused[0].json()["detail"], answers
    assert statuses[0] == 400 and f.body_bytes == 0  # the other read whole (and refused as protobuf)


def test_one_key_holds_only_its_share_of_the_servers_sessions_and_models(loop, front):
    """With several API keys, one key's clients cannot take every session or model the server
    holds (the others would get 429 until they closed): each key holds at most its share, the
    caps divided by the number of keys."""
    keys = ["tml-" + c * 28 for c in "ab"]
    f, *_ = serve(loop, front, api_keys=keys, max_sessions=4, max_models=2)
    SESSION = {"tags": [], "user_metadata": {}, "sdk_version": "x"}

    async def scenario():
        a, b = (httpx.AsyncClient(base_url=f"{f.base_url}/api/v1", headers={"X-API-Key": k}) for k in keys)
        async with a, b:
            a_sessions = [await a.post("/create_session", json=SESSION) for _ in range(3)]
            b_session = await b.post("/create_session", json=SESSION)
            sid = a_sessions[0].json()["session_id"]
            a_models = [await create(a, f, sid, seq) for seq in (0, 1)]
            b_model = await create(b, f, b_session.json()["session_id"])
            return (
                [r.status_code for r in a_sessions],
                b_session.status_code,
                [r.status_code for r in a_models],
                b_model,
            )

    a_sessions, b_session, a_models, b_model = loop.run_until_complete(scenario())
    assert a_sessions == [200, 200, 429] and b_session == 200
    assert a_models == [200, 429] and b_model.status_code == 200, b_model.text


async def saved(c: httpx.AsyncClient, model_id: str, seq: int, name: str, overwrite: bool = False) -> dict:
    """A save_weights of `name`, waited for: its answer, or its error."""
    body = {"model_id": model_id, "path": name, "seq_id": seq, "overwrite": overwrite}
    r = (await c.post("/save_weights", json=body)).json()
    return await wait(c, r["request_id"]) if "request_id" in r else r


def test_a_keys_checkpoints_are_bounded_and_deleting_one_frees_its_place(loop, front):
    """One key's clients saving checkpoint after checkpoint (new names, each a directory on the run's
    disk) are refused past `max_checkpoints_per_key`, naming it, while another key saves on; a
    save that replaces one of its own takes no new place, and RestClient.delete_checkpoint's
    DELETE frees one (another key's checkpoint is as unknown to it as one that never was)."""
    keys = ["tml-" + c * 28 for c in "ab"]
    f, *_ = serve(loop, front, api_keys=keys, max_checkpoints_per_key=2)

    async def scenario():
        a, b = (httpx.AsyncClient(base_url=f"{f.base_url}/api/v1", headers={"X-API-Key": k}) for k in keys)
        async with a, b:
            (_, ma), (_, mb) = await new_model(a, f), await new_model(b, f)
            a_id, b_id = ma["model_id"], mb["model_id"]
            out = {"a1": await saved(a, a_id, 1, "one"), "a2": await saved(a, a_id, 2, "two")}
            out["a3"] = await saved(a, a_id, 3, "three")
            out["a1 again"] = await saved(a, a_id, 4, "one", overwrite=True)
            out["b1"] = await saved(b, b_id, 1, "one")
            out["b deletes a's"] = await b.delete(f"/training_runs/{a_id}/checkpoints/weights/two")
            out["a deletes"] = await a.delete(f"/training_runs/{a_id}/checkpoints/weights/two")
            out["a deletes again"] = await a.delete(f"/training_runs/{a_id}/checkpoints/weights/two")
            out["a3 again"] = await saved(a, a_id, 5, "three")
            out["a listed"] = sorted(c["checkpoint_id"] for c in (await a.get("/checkpoints")).json()["checkpoints"])
            return out

    out = loop.run_until_complete(scenario())
    assert out["a1"]["path"].endswith("/weights/one") and out["a2"]["path"].endswith("/weights/two"), out
    assert "tinker.max_checkpoints_per_key" in out["a3"]["error"] and "delete" in out["a3"]["error"], out["a3"]
    assert out["a1 again"]["path"].endswith("/weights/one") and out["b1"]["path"].endswith("/weights/one"), out
    assert out["b deletes a's"].status_code == 400 and "no checkpoint" in out["b deletes a's"].text
    assert out["a deletes"].status_code == 204, out["a deletes"].text
    assert out["a deletes again"].status_code == 400 and "no checkpoint" in out["a deletes again"].text
    assert out["a3 again"]["path"].endswith("/weights/three"), out["a3 again"]
    assert out["a listed"] == ["weights/one", "weights/three"]


def test_a_keys_checkpoint_bytes_are_bounded_for_sampler_saves_too(loop, front):
    """Past `max_checkpoint_bytes_per_key` of saved checkpoints (training or sampler) a save is
    refused, naming it; the checkpoint a save replaces does not count against it."""
    f, *_ = serve(loop, front, max_checkpoint_bytes_per_key=1)

    async def sampler(c, model_id: str, seq: int, name: str) -> dict:
        body = {"model_id": model_id, "path": name, "seq_id": seq}
        return await wait(c, (await c.post("/save_weights_for_sampler", json=body)).json()["request_id"])

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            m = made["model_id"]
            first = await sampler(c, m, 1, "s")
            return first, await sampler(c, m, 2, "s"), await sampler(c, m, 3, "t"), await saved(c, m, 4, "w")

    first, replaced, second, weights = loop.run_until_complete(scenario())
    assert first["path"].endswith("/sampler_weights/s") and replaced["path"] == first["path"], (first, replaced)
    for refused in (second, weights):
        assert "tinker.max_checkpoint_bytes_per_key" in refused["error"], refused


@pytest.mark.parametrize(
    "checkpoint", ["weights/..", "weights/a%2F..%2F..%2Fx", "models/x", "sampler_weights/-x", "weights/w/publish"]
)
def test_a_delete_of_no_checkpoint_is_refused_and_deletes_nothing(loop, front, checkpoint):
    """A DELETE naming no checkpoint of the caller (a path out of the run directory, another kind,
    a name no save makes, a call forge does not serve) deletes nothing."""
    f, *_ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            await saved(c, made["model_id"], 1, "w")
            r = await c.delete(f"/training_runs/{made['model_id']}/checkpoints/{checkpoint}")
            return r, sorted(p.name for p in f.root.rglob("*") if p.is_dir())

    r, dirs = loop.run_until_complete(scenario())
    assert r.status_code in (400, 404), r.text
    assert "w" in dirs and "weights" in dirs, dirs


def test_an_expired_checkpoints_name_is_free_before_its_files_are_reaped(loop, front):
    """A checkpoint whose ttl_seconds passed is gone to every call (listing, loading), so a save
    of its name with overwrite=False is made, not refused as "exists", before the reaper has
    deleted its files."""
    f, *_ = serve(loop, front)

    async def scenario():
        async with client(f) as c:
            _, made = await new_model(c, f)
            body = {"model_id": made["model_id"], "path": "x", "seq_id": 1, "ttl_seconds": 1}
            await wait(c, (await c.post("/save_weights", json=body)).json()["request_id"])
            await asyncio.sleep(1.2)
            return await saved(c, made["model_id"], 2, "x")

    assert loop.run_until_complete(scenario()).get("path", "").endswith("/weights/x")


def test_a_checkpoints_ttl_is_set_or_removed_by_its_owner_only(loop, front):
    """RestClient.set_checkpoint_ttl's PUT: a ttl makes a kept checkpoint expire that many seconds
    from now, null keeps one that would have expired; a ttl out of range, of another type or
    another key's checkpoint is a 400 naming it, and changes nothing."""
    keys = ["tml-" + c * 28 for c in "ab"]
    f, *_ = serve(loop, front, api_keys=keys)

    async def scenario():
        a, b = (httpx.AsyncClient(base_url=f"{f.base_url}/api/v1", headers={"X-API-Key": k}) for k in keys)
        async with a, b:
            _, made = await new_model(a, f)
            m = made["model_id"]
            await saved(a, m, 1, "kept")
            body = {"model_id": m, "path": "brief", "seq_id": 2, "ttl_seconds": 2}
            await wait(a, (await a.post("/save_weights", json=body)).json()["request_id"])
            out = {"b's": await b.put(f"/training_runs/{m}/checkpoints/weights/kept/ttl", json={"ttl_seconds": 1})}
            for bad in (0, "1", 1.5, 10**12):
                out[f"ttl {bad!r}"] = await a.put(
                    f"/training_runs/{m}/checkpoints/weights/kept/ttl", json={"ttl_seconds": bad}
                )
            out["other field"] = await a.put(f"/training_runs/{m}/checkpoints/weights/kept/ttl", json={"ttl": 1})
            out["set"] = await a.put(f"/training_runs/{m}/checkpoints/weights/kept/ttl", json={"ttl_seconds": 1})
            out["removed"] = await a.put(
                f"/training_runs/{m}/checkpoints/weights/brief/ttl", json={"ttl_seconds": None}
            )
            await asyncio.sleep(2.2)
            out["listed"] = sorted(c["checkpoint_id"] for c in (await a.get("/checkpoints")).json()["checkpoints"])
            return out

    out = loop.run_until_complete(scenario())
    assert out["b's"].status_code == 400 and "no checkpoint" in out["b's"].text, out["b's"].text
    for k in ("ttl 0", "ttl '1'", "ttl 1.5", f"ttl {10**12!r}", "other field"):
        assert out[k].status_code == 400 and "ttl_seconds" in out[k].text, (k, out[k].text)
    assert out["set"].status_code == 204 and out["removed"].status_code == 204, (out["set"].text, out["removed"].text)
    assert out["listed"] == ["weights/brief"], out["listed"]


def test_saves_made_at_once_hold_the_quota_too(loop, front):
    """One key's saves from several models at once (each checks the quota before it writes):
    no more checkpoints are kept than max_checkpoints_per_key, the rest refused naming it."""
    f, trainer, _ = serve(loop, front, max_checkpoints_per_key=1)

    async def scenario():
        async with client(f) as c:
            sid = await session(c)
            made = [(await create(c, f, sid, seq)).json() for seq in range(3)]
            for m in made:
                await wait(c, m["request_id"])
            trainer.delay["save_tenant"] = 0.2  # all three check before any has written
            return await asyncio.gather(*(saved(c, m["model_id"], 1, f"w{i}") for i, m in enumerate(made)))

    results = loop.run_until_complete(scenario())
    assert sum("path" in r for r in results) == 1, results
    assert all("tinker.max_checkpoints_per_key" in r["error"] for r in results if "path" not in r), results


def test_a_body_nested_past_the_parser_is_a_400(loop, front):
    f, *_ = serve(loop, front)

    async def go():
        async with client(f) as c:
            _, made = await new_model(c, f)
            await saved(c, made["model_id"], 1, "w")
            return await c.put(f"/training_runs/{made['model_id']}/checkpoints/weights/w/ttl", content=b"[" * 5000)

    r = loop.run_until_complete(go())
    assert r.status_code == 400, r.text
