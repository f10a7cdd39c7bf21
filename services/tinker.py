"""`forge tinker`: the Tinker API over forge's trainer and generator services, so code written for
the `tinker` SDK (and the tinker-cookbook's recipes) trains on a user's own machines.

    front = TinkerFront(trainer, gen, model_dir, TinkerConfig(), run_dir, vocab_size, max_model_len)
    server = await front.serve()          # HTTP on cfg.host:cfg.port, /api/v1/...
    ...
    await front.shutdown()

A front door, as the gateway is: it translates the protocol into service calls and owns no
training state. Each training client is a tenant of the trainer (its own LoRA adapter, optimizer
state and step count; services/tenants.py) and each sampler a LoRA policy of the generators
(`Generator.add_policy`). What it keeps is the protocol's: sessions and their owners (an API key),
each model's requests in `seq_id` order (a retried one answered once), futures that clients
long-poll, and where `tinker://` paths live on disk (RUN/tinker/MODEL_ID/{weights,sampler_weights}/NAME).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import math
import random
import re
import secrets
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from forge import console
from forge.http_bounds import bounded_http
from forge.lora import read_adapter, write_adapter
from services.schema import TinkerConfig
from services.tenants import modules_of
from services.tinker_wire import (
    Limits,
    UserError,
    decode_forward_backward,
    encode_forward_backward,
    encode_sample,
    parse,
    prompt_tokens,
    sampling_args,
)

log = logging.getLogger("forge")
API = "/api/v1"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PATH = re.compile(
    r"tinker://([A-Za-z0-9][A-Za-z0-9._:-]{0,199})/(weights|sampler_weights)/([A-Za-z0-9][A-Za-z0-9._-]{0,127})"
)
META = "forge_tinker.json"  # beside a checkpoint's files: its owner, kind and LoRA shape
KINDS = {"weights": "training", "sampler_weights": "sampler"}
MAX_TTL_S = 100 * 365 * 86400  # a checkpoint's ttl_seconds at most (its expiry stays a date)


class Refused(Exception):
    """An HTTP answer other than 200 (the request itself is refused, no future is made)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Pending:
    """A submitted request's future: the client polls `retrieve_future` until it is done."""

    session: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Any = None  # a JSON-able dict, or protobuf bytes
    error: tuple[str, str] | None = None  # (message, category)
    finished: float = 0.0


@dataclass
class Model:
    """A training client: a trainer tenant, its requests applied in seq_id order."""

    id: str
    session: str
    rank: int
    modules: set[str]
    created: asyncio.Event = field(default_factory=asyncio.Event)
    next_seq: int = 1
    waiting: dict[int, tuple[Pending, Callable[[], Awaitable[Any]]]] = field(default_factory=dict)
    draining: bool = False


@dataclass
class Sampler:
    id: str
    policy: str  # the generator's LoRA policy ("": the base model)
    model_path: str | None


@dataclass
class Session:
    id: str
    owner: str
    seen: float
    models: dict[str, Model] = field(default_factory=dict)
    samplers: collections.OrderedDict[str, Sampler] = field(default_factory=collections.OrderedDict)
    # one sampler loads at a time: its cap holds on the generators, and a retry finds the first's
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)


def _iso(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _count(text: str, name: str) -> int:
    """A query parameter that counts (a page's `limit`, `offset`): an integer >= 0."""
    if not (text.isascii() and text.isdigit() and len(text) <= 18):  # what int() reads, below 2**63
        raise UserError(f"{name}: {text[:40]!r}; an integer >= 0")
    return int(text)


def _json_safe(value: Any) -> Any:
    """`value` with each non-finite float as its name ("NaN", "Infinity"): JSON has no such
    numbers, and the SDK's pydantic types read these strings back as the floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


async def _save_into(where: Path, write: Callable[[Path], Awaitable[Any]]) -> None:
    """`write` a checkpoint into a fresh directory beside `where`, then put it in `where`'s place:
    a save that fails leaves nothing behind, and the checkpoint it was to overwrite stays whole."""
    part = where.with_name(f".{where.name}.part")  # no checkpoint name starts with "."
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        await write(part)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    shutil.rmtree(where, ignore_errors=True)
    part.rename(where)


# What AdamW takes of each of the SDK's AdamParams (a negative grad_clip_norm would scale the
# gradients by a negative factor: the step would climb the loss).
ADAM_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "learning_rate": (">= 0", lambda v: v >= 0),
    "beta1": ("in [0, 1)", lambda v: 0 <= v < 1),
    "beta2": ("in [0, 1)", lambda v: 0 <= v < 1),
    "eps": ("> 0", lambda v: v > 0),
    "weight_decay": (">= 0", lambda v: v >= 0),
    "grad_clip_norm": (">= 0 (0: none)", lambda v: v >= 0),
}


def _adam_params(adam: types.AdamParams) -> dict[str, float]:
    """`adam` as the trainer's dict; a value out of its range is a UserError naming it."""
    params = adam.model_dump()
    for name, value in params.items():
        want, ok = ADAM_RANGES.get(name, ("", lambda v: True))
        if not (math.isfinite(value) and ok(value)):
            raise UserError(f"adam_params.{name}: {value}; a finite number {want}".rstrip())
    return params


def _check_optimizer(config: types.OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise UserError(f"optimizer_config: {config.type!r} is not supported (forge: adamw)")


def _size(where: Path) -> int:
    """The bytes of a checkpoint's files (those its expiry deletes meanwhile count 0)."""
    total = 0
    for f in where.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total


def _store_meta(where: Path, meta: dict[str, Any]) -> None:
    part = where / f"{META}.part"  # whole or absent: a server killed mid-write leaves no cut one
    part.write_text(json.dumps(meta))
    part.replace(where / META)


def _expired(meta: dict[str, Any] | None) -> bool:
    """Whether a checkpoint's ttl_seconds have passed (its files may not be reaped yet)."""
    expires = (meta or {}).get("expires")
    return expires is not None and expires < time.time()


def _category(e: BaseException) -> str:
    return "user" if isinstance(e, (UserError, ValueError, KeyError)) else "server"


class TinkerFront:
    """The Tinker API's server over a Trainer service (LoRA, tenants) and a Generator service."""

    def __init__(
        self,
        trainer: Any,
        gen: Any,
        model_dir: str | Path,
        cfg: TinkerConfig,
        run_dir: str | Path,
        vocab_size: int,
        max_model_len: int,
        max_tokens: int = 32,
    ):
        self.trainer, self.gen, self.cfg = trainer, gen, cfg
        self.model_dir = Path(model_dir).resolve()
        self.base_model = cfg.base_model or str(self.model_dir)
        self.root = Path(run_dir).resolve() / "tinker"
        self.vocab, self.max_len, self.max_tokens = vocab_size, max_model_len, max_tokens
        self.limits = Limits(cfg.max_datums, cfg.max_tokens, cfg.max_seq_len)
        # A JSON body's bytes: its fields, and a prompt of max_model_len tokens (16 bytes a token: "123456, ")
        self.json_bytes = min(cfg.max_request_bytes, (64 << 10) + 16 * max_model_len)
        self.body_bytes = 0  # of the requests being read and handled (max_body_bytes_in_flight)
        # one save at a time per key: its quota is checked and its checkpoint written under it
        self.saving: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.sessions: dict[str, Session] = {}
        self.futures: dict[str, Pending] = {}
        self.keys: dict[tuple[Any, ...], str] = {}  # a request's logical key -> its future (retries)
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, tuple[Session, Sampler]] = {}
        self.sample_seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        # Every live sampler's adapter: a respawned generator replica loads them again (its restore point).
        self.adapters: dict[str, tuple[Any, Any]] = {}
        gen.set_restore_point(self.adapters)
        self._server: Any = None
        self._tasks: set[asyncio.Task] = set()

    # ---- the HTTP server -----------------------------------------------------------

    def app(self) -> Starlette:
        post = {
            "client/config": self.client_config,
            "client/dynamic_config": self.dynamic_config,
            "create_session": self.create_session,
            "session_heartbeat": self.heartbeat,
            "telemetry": self.telemetry,
            "create_model": self.create_model,
            "get_info": self.get_info,
            "forward_backward": self.forward_backward,
            "optim_step": self.optim_step,
            "save_weights": self.save_weights,
            "load_weights": self.load_weights,
            "save_weights_for_sampler": self.save_for_sampler,
            "create_sampling_session": self.create_sampling_session,
            "asample": self.asample,
            "retrieve_future": self.retrieve_future,
            "cancel_future": self.cancel_future,
            "weights_info": self.weights_info,
        }
        get = {
            "healthz": self.healthz,
            "get_server_capabilities": self.capabilities,
            "samplers/{sampler_id}": self.get_sampler,
            "training_runs/{run_id}/checkpoints": self.list_run_checkpoints,
            "checkpoints": self.list_checkpoints,
        }
        # JSON bodies are parsed in the event loop (the SDK's types): at most a prompt's worth. The
        # protobuf forward_backward, and telemetry (read, never parsed), take max_request_bytes.
        big = {"forward_backward", "telemetry"}
        routes = [
            Route(f"{API}/{p}", self._wrap(h, None if p in big else self.json_bytes), methods=["POST"])
            for p, h in post.items()
        ]
        routes += [Route(f"{API}/{p}", self._wrap(h), methods=["GET"]) for p, h in get.items()]
        routes.append(Route(f"{API}/sessions/{{session_id}}/finish", self._wrap(self.finish), methods=["POST"]))
        one = f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}"
        routes.append(Route(one, self._wrap(self.delete_checkpoint), methods=["DELETE"]))
        routes.append(Route(f"{one}/ttl", self._wrap(self.set_checkpoint_ttl, self.json_bytes), methods=["PUT"]))
        every = ["GET", "POST", "PUT", "PATCH", "DELETE"]  # the SDK's other calls: named, not a bare 404
        routes.append(Route(f"{API}/{{call:path}}", self._wrap(self.unserved, self.json_bytes), methods=every))
        return Starlette(routes=routes)

    def _wrap(
        self, handler: Callable[[Request, str, bytes], Awaitable[Any]], limit: int | None = None
    ) -> Callable[[Request], Awaitable[Response]]:
        """`handler` as an endpoint: the caller's key checked, a POST's body read (at most `limit`
        bytes; None: max_request_bytes), its errors as HTTP answers."""

        async def endpoint(request: Request) -> Response:
            held = [0]  # this request's bytes in self.body_bytes, until its answer
            try:
                owner = self._owner(request)
                body = await self._body(request, held, limit) if request.method in ("POST", "PUT") else b""
                out = await handler(request, owner, body)
            except Refused as e:
                return JSONResponse({"detail": str(e)}, status_code=e.status)
            except (ValueError, RecursionError) as e:  # UserError, what the SDK's types or json refuse
                console.report("tinker request refused", str(e))
                return JSONResponse({"detail": str(e)}, status_code=400)
            except Exception as e:  # a service call failed: the client may try again
                log.warning("forge tinker: %s failed: %s", request.url.path, e)
                return JSONResponse({"detail": f"{type(e).__name__}: {e}"}, status_code=500)
            finally:
                self.body_bytes -= held[0]
            if isinstance(out, Response):
                return out
            return JSONResponse(_json_safe(out))  # a diverged step's grad norm is still its answer

        return endpoint

    def _owner(self, request: Request) -> str:
        """Who calls: the API key's owner (or "local" when the server takes none)."""
        if request.url.path == f"{API}/healthz":
            return ""
        if not self.cfg.api_keys:
            return "local"
        given = request.headers.get("x-api-key", "")
        for key in self.cfg.api_keys:
            if hmac.compare_digest(given.encode(), key.encode()):
                return hashlib.sha256(key.encode()).hexdigest()[:32]
        raise Refused(401, "missing or unknown X-API-Key")

    async def _body(self, request: Request, held: list[int], limit: int | None = None) -> bytes:
        """The request's body, at most `limit` bytes (default `max_request_bytes`; read no further),
        not compressed; its bytes counted in `held[0]` and `body_bytes`, within
        max_body_bytes_in_flight."""
        if request.headers.get("content-encoding", "identity") != "identity":
            raise Refused(415, "compressed bodies are not taken (client/config proto_compress_fwdbwd is false)")
        if limit is None:
            limit, why = self.cfg.max_request_bytes, "tinker.max_request_bytes"
        else:
            why = f"a JSON request holds at most a prompt of max_model_len ({self.max_len}) tokens"
        if int(request.headers.get("content-length") or 0) > limit:
            raise Refused(413, f"request body over {limit} bytes ({why})")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused(413, f"request body over {limit} bytes ({why})")
            held[0] += len(chunk)
            self.body_bytes += len(chunk)
            if self.body_bytes > self.cfg.max_body_bytes_in_flight:
                raise Refused(
                    503,
                    f"request bodies over {self.cfg.max_body_bytes_in_flight} bytes at once "
                    "(tinker.max_body_bytes_in_flight); retry",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def serve(self) -> Any:
        """Start the HTTP server (and the session reaper); returns once it listens."""
        import uvicorn

        http = bounded_http(self.cfg.request_deadline_s, self.cfg.max_connections)
        config = uvicorn.Config(self.app(), host=self.cfg.host, port=self.cfg.port, log_level="warning", http=http)
        self._server = uvicorn.Server(config)
        self._serving = asyncio.ensure_future(self._server.serve())
        self._spawn(self._reap())
        while not self._server.started:
            if self._serving.done():  # e.g. the port is taken
                self._serving.result()
                raise OSError(f"forge tinker: cannot listen on {self.cfg.host}:{self.cfg.port}")
            await asyncio.sleep(0.05)
        return self._server

    @property
    def base_url(self) -> str:
        sock = self._server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def shutdown(self) -> None:
        for session in list(self.sessions.values()):
            await self._close(session)
        if self._server is not None:
            self._server.should_exit = True
            await self._serving
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- sessions --------------------------------------------------------------------

    async def client_config(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        return {
            "pjwt_auth_enabled": False,
            "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": self.cfg.max_datums,
            # The SDK's estimate (4 bytes a token + the tensors) stays under the server's byte limit,
            # and, at 16 bytes a token at least (an int64 target and a float32 input), its token limit.
            "fwdbwd_max_chunk_bytes_count": min(self.cfg.max_request_bytes // 2, 16 * self.cfg.max_tokens),
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    async def dynamic_config(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    async def unserved(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        raise Refused(404, f"{request.method} {request.url.path} is not served by forge tinker")

    async def healthz(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        return {"status": "ok"}

    async def telemetry(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        return {"status": "accepted"}  # dropped: nothing leaves this machine

    async def capabilities(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        model = {"model_name": self.base_model, "max_context_length": self.max_len, "trainable": True}
        return {"supported_models": [{**model, "sampleable": True}]}

    async def create_session(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        parse(types.CreateSessionRequest, body)
        if len(self.sessions) >= self.cfg.max_sessions:
            raise Refused(429, f"the server holds {self.cfg.max_sessions} sessions (tinker.max_sessions)")
        self._within_share(owner, "sessions", [s.owner for s in self.sessions.values()])
        sid = f"sess-{secrets.token_hex(12)}"
        self.sessions[sid] = Session(sid, owner, time.monotonic())
        return {"session_id": sid, "type": "create_session"}

    def _within_share(self, owner: str, what: str, owners: list[str]) -> None:
        """A 429 once `owner` holds its share of the server's `what` (tinker.max_<what> over the
        number of API keys): one key's clients never hold all of them, the other keys' none."""
        share = max(1, getattr(self.cfg, f"max_{what}") // max(1, len(self.cfg.api_keys)))
        if owners.count(owner) >= share:
            raise Refused(
                429, f"this API key holds {share} {what}, its share of tinker.max_{what} over the server's keys"
            )

    def _session(self, sid: str, owner: str) -> Session:
        """`owner`'s open session `sid`; another owner's is as unknown as one that never was."""
        session = self.sessions.get(sid)
        if session is None or session.owner != owner:
            raise UserError(
                f"no open session {sid!r} (closed after {self.cfg.session_timeout_s:g} s without a heartbeat?)"
            )
        session.seen = time.monotonic()
        return session

    async def heartbeat(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.SessionHeartbeatRequest, body)
        if req.session_id not in self.sessions or self.sessions[req.session_id].owner != owner:
            raise Refused(410, f"no open session {req.session_id!r}")
        self._session(req.session_id, owner)
        return {"type": "session_heartbeat"}

    async def finish(self, request: Request, owner: str, body: bytes) -> Response:
        session = self._session(request.path_params["session_id"], owner)
        await self._close(session)
        return Response(status_code=204)

    async def _reap(self) -> None:
        """Close the sessions whose client stopped beating: their adapters, samplers and futures go."""
        while True:
            await asyncio.sleep(min(5.0, self.cfg.session_timeout_s / 2))
            await asyncio.to_thread(self._expire)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.seen > self.cfg.session_timeout_s:
                    log.info("forge tinker: session %s timed out; its adapters are freed", session.id)
                    await self._close(session)
            old = [r for r, p in self.futures.items() if p.done.is_set() and now - p.finished > 600]
            for rid in old:  # results nobody came back for (and their retries' keys)
                self.futures.pop(rid, None)
            if old:
                self.keys = {k: r for k, r in self.keys.items() if r in self.futures}

    async def _close(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        for model in list(session.models.values()):
            self._forget(model, f"session {session.id} closed", "user")
            await self._quietly(self.trainer.remove_tenant.route(model.id))
        for sampler in session.samplers.values():
            await self._release(sampler)
        for rid in [r for r, p in self.futures.items() if p.session == session.id]:
            self.futures.pop(rid, None)
        self.keys = {k: r for k, r in self.keys.items() if r in self.futures}

    async def _quietly(self, call: Awaitable[Any]) -> None:
        try:
            await call
        except Exception as e:  # freeing what is gone already
            log.warning("forge tinker: %s", e)

    # ---- futures ---------------------------------------------------------------------

    def _room(self, session: Session) -> None:
        """A 429 if `session` has `max_inflight_per_session` requests in flight."""
        busy = sum(1 for p in self.futures.values() if p.session == session.id and not p.done.is_set())
        if busy >= self.cfg.max_inflight_per_session:
            raise Refused(429, f"{busy} requests in flight for this session (tinker.max_inflight_per_session)")

    def _admit(self, session: Session, key: tuple[Any, ...]) -> tuple[str, Pending | None]:
        """The future of `key` if it was submitted before (a retry), else a new one."""
        if key in self.keys and self.keys[key] in self.futures:
            return self.keys[key], None
        self._room(session)
        rid = f"req-{uuid.uuid4().hex}"
        pending = Pending(session.id)
        self.futures[rid], self.keys[key] = pending, rid
        return rid, pending

    def _submit(self, session: Session, key: tuple[Any, ...], op: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
        rid, pending = self._admit(session, key)
        if pending is not None:
            self._spawn(self._run(pending, op))
        return {"request_id": rid}

    async def _run(self, pending: Pending, op: Callable[[], Awaitable[Any]]) -> None:
        try:
            result = await op()
        except Exception as e:
            self._fail(pending, str(e) or type(e).__name__, _category(e))
        else:
            pending.result, pending.finished = result, time.monotonic()
            pending.done.set()

    def _fail(self, pending: Pending, message: str, category: str) -> None:
        if category == "server":
            log.warning("forge tinker: request failed: %s", message)
        else:
            console.report("tinker request failed", message)
        pending.error, pending.finished = (message, category), time.monotonic()
        pending.done.set()

    async def retrieve_future(self, request: Request, owner: str, body: bytes) -> Any:
        req = parse(types.FutureRetrieveRequest, body)
        pending = self.futures.get(req.request_id)
        if pending is None or pending.session not in self.sessions or self.sessions[pending.session].owner != owner:
            raise Refused(404, f"no request {req.request_id!r}")
        session = self.sessions[pending.session]
        session.seen = time.monotonic()
        try:  # a client waiting here is alive: the wait ends well within the session's timeout
            await asyncio.wait_for(pending.done.wait(), min(self.cfg.poll_s, self.cfg.session_timeout_s / 2))
        except TimeoutError:
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        finally:
            session.seen = time.monotonic()
        if pending.error is not None:
            return {"error": pending.error[0], "category": pending.error[1]}
        if isinstance(pending.result, bytes):
            return Response(pending.result, media_type="application/x-protobuf")
        return pending.result

    async def cancel_future(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        return {}

    # ---- training --------------------------------------------------------------------

    def _model(self, model_id: str, owner: str) -> Model:
        model = self.models.get(model_id)
        session = self.sessions.get(model.session) if model is not None else None
        if session is None or session.owner != owner:
            raise UserError(f"no model {model_id!r} (its session closed?)")
        session.seen = time.monotonic()
        return model

    def _check_base(self, base_model: str | None) -> None:
        if base_model is None or base_model == self.base_model:
            return
        try:
            served = Path(base_model).is_dir() and Path(base_model).resolve() == self.model_dir
        except OSError:  # e.g. a name longer than a path may be
            served = False
        if not served:
            raise UserError(f"base_model {base_model!r} is not served here; this server serves {self.base_model!r}")

    def _new_model(self, session: Session, seq: int) -> Model:
        if len(session.models) >= self.cfg.max_models_per_session:
            raise Refused(429, f"session holds {len(session.models)} models (tinker.max_models_per_session)")
        if len(self.models) >= self.cfg.max_models:
            raise Refused(429, f"the server holds {len(self.models)} models (tinker.max_models)")
        # a closing session's models (its entry gone, theirs going) no longer count
        held = [s.owner for m in self.models.values() if (s := self.sessions.get(m.session)) is not None]
        self._within_share(session.owner, "models", held)
        model = Model(f"{session.id}:train:{seq}", session.id, 0, set())
        if model.id in self.models:
            raise UserError(f"model {model.id} exists (model_seq_id {seq} was used)")
        self._room(session)  # refused here, a retry of this model_seq_id is a new request
        session.models[model.id] = self.models[model.id] = model
        return model

    async def create_model(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.CreateModelRequest, body)
        session = self._session(req.session_id, owner)
        self._check_base(req.base_model)
        lora = req.lora_config or types.LoraConfig(rank=self.cfg.max_lora_rank)
        _check_optimizer(req.optimizer_config)
        if not 0 < lora.rank <= self.cfg.max_lora_rank:
            raise UserError(f"lora_config.rank: {lora.rank}; this server takes 1 to {self.cfg.max_lora_rank}")
        if lora.seed is not None and not -(2**63) <= lora.seed < 2**64:  # what a torch generator takes
            raise UserError(f"lora_config.seed: {lora.seed}; a 64-bit integer")
        modules = modules_of(lora.train_mlp, lora.train_attn, lora.train_unembed)
        if not modules:
            raise UserError("lora_config: train_mlp, train_attn and train_unembed are all false")
        key = ("create", session.id, req.model_seq_id)
        if key in self.keys:
            return {"request_id": self.keys[key], "model_id": f"{session.id}:train:{req.model_seq_id}"}
        model = self._new_model(session, req.model_seq_id)
        model.rank, model.modules = lora.rank, modules
        seed = lora.seed if lora.seed is not None else secrets.randbits(31)

        async def create() -> dict[str, Any]:
            await self._created(
                model, self.trainer.add_tenant.route(model.id, lora.rank, self.cfg.lora_alpha, modules, seed)
            )
            return {"model_id": model.id, "type": "create_model"}

        return {**self._submit(session, key, create), "model_id": model.id}

    async def _created(self, model: Model, creating: Awaitable[Any]) -> None:
        """Await `model`'s tenant being made; its queued requests run after. If that fails, they
        fail with it; if its session closed meanwhile, the tenant goes at once."""
        try:
            await creating
        except Exception as e:
            self._forget(model, f"model {model.id} was not made: {e}", _category(e))
            await self._quietly(self.trainer.remove_tenant.route(model.id))
            raise
        if model.id not in self.models:
            await self._quietly(self.trainer.remove_tenant.route(model.id))
            raise UserError(f"model {model.id}: its session closed")
        model.created.set()

    def _forget(self, model: Model, why: str, category: str) -> None:
        """`model` gone: its queued requests fail with `why`, its drain ends."""
        self.models.pop(model.id, None)
        if model.session in self.sessions:
            self.sessions[model.session].models.pop(model.id, None)
        for pending, _ in model.waiting.values():
            self._fail(pending, why, category)
        model.waiting.clear()
        model.created.set()  # a drain waiting for it wakes, finds it gone, and ends

    async def get_info(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.GetInfoRequest, body)
        model = self._model(req.model_id, owner)
        return {
            "type": "get_info",
            "model_id": model.id,
            "model_data": {"arch": "lora", "model_name": self.base_model, "tokenizer_id": str(self.model_dir)},
            "is_lora": True,
            "lora_rank": model.rank,
            "model_name": self.base_model,
        }

    def _ordered(self, model: Model, seq_id: int | None, op: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
        """Submit `op` as `model`'s request `seq_id`: it runs once every lower one has, and once only."""
        session = self.sessions[model.session]
        if seq_id is None:
            raise UserError("seq_id is required")
        key = ("seq", model.id, seq_id)
        if key not in self.keys and seq_id < model.next_seq:
            raise UserError(f"seq_id {seq_id} of model {model.id} was applied already")
        if seq_id > model.next_seq + self.cfg.max_inflight_per_session:
            raise UserError(f"seq_id {seq_id} is far ahead of model {model.id}'s next ({model.next_seq})")
        rid, pending = self._admit(session, key)
        if pending is not None:
            model.waiting[seq_id] = (pending, op)
            if not model.draining:
                self._spawn(self._drain(model))
        return {"request_id": rid, "model_id": model.id}

    async def _drain(self, model: Model) -> None:
        model.draining = True
        try:
            await model.created.wait()
            while model.next_seq in model.waiting and model.id in self.models:
                pending, op = model.waiting.pop(model.next_seq)
                await self._run(pending, op)
                model.next_seq += 1
        finally:
            model.draining = False

    async def forward_backward(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        fb = decode_forward_backward(body, self.vocab, self.limits)
        model = self._model(fb.model_id, owner)

        async def run() -> bytes:
            logprobs: list[list[float]] = [[] for _ in range(fb.count)]
            loss = 0.0
            for rows, datums in fb.batches:  # Tinker's losses are sums, gradients add up: each batch its own call
                got, part = await self.trainer.forward_backward.route(
                    model.id, datums, fb.loss_fn, fb.config, not fb.forward_only, self.cfg.tokens_per_pass
                )
                for i, row in zip(rows, got):
                    logprobs[i] = row
                loss += part
            return encode_forward_backward(logprobs, loss)

        return self._ordered(model, fb.seq_id, run)

    async def optim_step(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.OptimStepRequest, body)
        model = self._model(req.model_id, owner)
        adam = req.optim_params
        if not isinstance(adam, types.AdamParams):
            raise UserError(f"optim_step: optimizer {getattr(adam, 'type', '?')!r} is not supported (forge: adamw)")
        params = _adam_params(adam)

        async def run() -> dict[str, Any]:
            metrics = await self.trainer.optim_step.route(model.id, params)
            return {"metrics": {"grad_norm:mean": metrics["grad_norm"]}}

        return self._ordered(model, req.seq_id, run)

    def _checkpoint(self, model: Model, kind: str, name: str | None, overwrite: bool) -> tuple[Path, str]:
        if name is None or not NAME.fullmatch(name):
            raise UserError(f"path {name!r}: a checkpoint name is 1-128 letters, digits, '.', '_' or '-'")
        where = self.root / model.id / kind / name
        if where.exists() and not overwrite and not _expired(self._read_meta(where / META)):
            raise UserError(f"checkpoint tinker://{model.id}/{kind}/{name} exists (overwrite=True replaces it)")
        return where, f"tinker://{model.id}/{kind}/{name}"

    @staticmethod
    def _ttl(ttl_s: int | None) -> int | None:
        """A checkpoint's `ttl_seconds`: none, or 1 s to MAX_TTL_S (its expiry a date)."""
        if ttl_s is not None and not 0 < ttl_s <= MAX_TTL_S:
            raise UserError(f"ttl_seconds: {ttl_s}; 1 to {MAX_TTL_S} (or none: kept)")
        return ttl_s

    def _write_meta(self, where: Path, model: Model, owner: str, kind: str, ttl_s: int | None) -> None:
        now = time.time()
        meta = {"owner": owner, "kind": kind, "rank": model.rank, "modules": sorted(model.modules), "time": now}
        meta["expires"] = now + ttl_s if ttl_s else None
        _store_meta(where, {**meta, "base_model": self.base_model})

    @staticmethod
    def _read_meta(meta_file: Path) -> dict[str, Any] | None:
        """A checkpoint's metadata; None if unreadable (cut short, or deleted as it was read)."""
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def _expire(self) -> None:
        """Delete the checkpoints whose ttl_seconds have passed."""
        for meta_file in self.root.glob(f"*/*/*/{META}"):
            if _expired(self._read_meta(meta_file)):
                shutil.rmtree(meta_file.parent, ignore_errors=True)

    async def save_weights(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.SaveWeightsRequest, body)
        model = self._model(req.model_id, owner)
        where, path = self._checkpoint(model, "weights", req.path, req.overwrite)
        ttl = self._ttl(req.ttl_seconds)

        async def run() -> dict[str, Any]:
            self._checkpoint(model, "weights", req.path, req.overwrite)  # again: an earlier request may have made it
            await self._saved(
                owner, model, where, "weights", ttl, lambda part: self.trainer.save_tenant.route(model.id, str(part))
            )
            return {"path": path, "type": "save_weights"}

        return self._ordered(model, req.seq_id, run)

    async def save_for_sampler(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.SaveWeightsForSamplerRequest, body)
        model = self._model(req.model_id, owner)
        if req.path is None:
            if req.sampling_session_seq_id is None:
                raise UserError("save_weights_for_sampler: give a path (a name) or a sampling_session_seq_id")
            sampler_id = f"{model.session}:sample:{req.sampling_session_seq_id}"

            async def live() -> dict[str, Any]:
                tensors, lora = await self.trainer.tenant_adapter.route(model.id)
                await self._add_sampler(self.sessions[model.session], sampler_id, tensors, lora, None)
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return self._ordered(model, req.seq_id, live)
        where, path = self._checkpoint(model, "sampler_weights", req.path, overwrite=True)
        ttl = self._ttl(req.ttl_seconds)

        async def save() -> dict[str, Any]:
            tensors, lora = await self.trainer.tenant_adapter.route(model.id)

            async def write(part: Path) -> None:
                await asyncio.to_thread(write_adapter, part, tensors, lora, str(self.model_dir))

            await self._saved(owner, model, where, "sampler_weights", ttl, write)
            return {"path": path, "type": "save_weights_for_sampler"}

        return self._ordered(model, req.seq_id, save)

    async def _saved(
        self, owner: str, model: Model, where: Path, kind: str, ttl: int | None, write: Callable[[Path], Awaitable[Any]]
    ) -> None:
        """A checkpoint of `owner`'s at `where`, written by `write(part)` within the key's quota
        (one save of a key at a time: each checks the quota before it writes)."""
        async with self.saving[owner]:
            await asyncio.to_thread(self._check_room, owner, where)
            await _save_into(where, write)
            self._write_meta(where, model, owner, kind, ttl)

    def _resolve(self, path: str, owner: str, kind: str, to_load: bool = True) -> tuple[Path, dict[str, Any]]:
        """The directory of `owner`'s checkpoint `path` (a tinker:// path of `kind`) and its
        metadata; `to_load`: it must be of the base model served here."""
        found = PATH.fullmatch(path or "")
        if found is None or found.group(2) != kind:
            raise UserError(f"path {path!r}: expected tinker://MODEL_ID/{kind}/NAME")
        where = self.root / found.group(1) / kind / found.group(3)
        meta = self._read_meta(where / META)
        if meta is None or meta.get("owner") != owner or _expired(meta):
            raise UserError(f"no checkpoint {path!r}")
        base = meta.setdefault("base_model", self.base_model)
        if to_load and base != self.base_model:  # the run directory outlived a server of another model
            raise UserError(f"checkpoint {path!r} is of base_model {base!r}; this server serves {self.base_model!r}")
        return where, meta

    async def load_weights(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.LoadWeightsRequest, body)
        if req.model_id is not None:  # the deprecated TrainingClient.load_state: an ordered request
            model = self._model(req.model_id, owner)
            where, _ = self._resolve(req.path, owner, "weights")

            async def load() -> dict[str, Any]:
                await self.trainer.load_tenant.route(model.id, str(where), bool(req.optimizer))
                return {"path": req.path, "model_id": model.id, "type": "load_weights"}

            return self._ordered(model, req.seq_id, load)
        if req.session_id is None or req.model_seq_id is None:
            raise UserError("load_weights: give model_id and seq_id, or session_id and model_seq_id")
        session = self._session(req.session_id, owner)
        self._check_base(req.base_model)
        _check_optimizer(req.optimizer_config)
        where, meta = self._resolve(req.path, owner, "weights")
        key = ("create", session.id, req.model_seq_id)
        if key in self.keys:
            return {"request_id": self.keys[key], "model_id": f"{session.id}:train:{req.model_seq_id}"}
        model = self._new_model(session, req.model_seq_id)
        model.rank, model.modules = meta["rank"], set(meta["modules"])

        async def add_and_load() -> None:
            await self.trainer.add_tenant.route(model.id, model.rank, self.cfg.lora_alpha, model.modules, 0)
            await self.trainer.load_tenant.route(model.id, str(where), bool(req.optimizer))

        async def create_and_load() -> dict[str, Any]:
            await self._created(model, add_and_load())
            return {"path": req.path, "model_id": model.id, "type": "load_weights"}

        return {**self._submit(session, key, create_and_load), "model_id": model.id}

    async def weights_info(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        try:
            given = json.loads(body or b"{}")
        except ValueError:  # not JSON, or not UTF-8
            given = None
        if not isinstance(given, dict) or not isinstance(given.get("tinker_path"), str):
            raise UserError('weights_info: the body is {"tinker_path": "tinker://..."}')
        path = given["tinker_path"]
        kind = "sampler_weights" if "/sampler_weights/" in str(path) else "weights"
        _, meta = self._resolve(str(path), owner, kind, to_load=False)
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": meta["rank"]}

    # ---- sampling --------------------------------------------------------------------

    async def _add_sampler(self, session: Session, sampler_id: str, tensors: Any, lora: Any, path: str | None) -> None:
        """A sampler on the generators: its adapter as a LoRA policy of its own, loaded on every
        replica. A session's samplers load one at a time, its oldest freed first when it holds
        `max_samplers_per_session`."""
        async with session.loading:
            if sampler_id in self.samplers:  # a retry, or another request for the same one
                return
            while len(session.samplers) >= self.cfg.max_samplers_per_session:  # the oldest goes
                _, oldest = session.samplers.popitem(last=False)
                await self._release(oldest)
            sampler = Sampler(sampler_id, sampler_id if tensors is not None else "", path)
            if tensors is not None:
                await self.gen.add_policy.fanout(sampler.policy, lora)
                try:
                    await self.gen.load_weights.fanout(tensors, 1, policy=sampler.policy)
                except Exception:
                    await self._quietly(self.gen.remove_policy.fanout(sampler.policy))
                    raise
            if session.id not in self.sessions:  # closed while it loaded: nothing holds it
                await self._release(sampler)
                raise UserError(f"sampling session {sampler_id}: its session closed")
            if tensors is not None:
                self.adapters[sampler.policy] = (lora, tensors)
            session.samplers[sampler_id] = sampler
            self.samplers[sampler_id] = (session, sampler)

    async def _release(self, sampler: Sampler) -> None:
        self.samplers.pop(sampler.id, None)
        self.adapters.pop(sampler.policy, None)
        if sampler.policy:
            await self._quietly(self.gen.remove_policy.fanout(sampler.policy))

    async def create_sampling_session(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.CreateSamplingSessionRequest, body)
        session = self._session(req.session_id, owner)
        sampler_id = f"{session.id}:sample:{req.sampling_session_seq_id}"
        if req.model_path:
            where, _ = self._resolve(req.model_path, owner, "sampler_weights")
            lora, tensors = await asyncio.to_thread(read_adapter, where)
            await self._add_sampler(session, sampler_id, tensors, lora, req.model_path)
        else:
            self._check_base(req.base_model)
            await self._add_sampler(session, sampler_id, None, None, None)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def _sampler(self, sampler_id: str | None, owner: str) -> tuple[Session, Sampler]:
        found = self.samplers.get(sampler_id or "")
        if found is None or found[0].owner != owner or found[0].id not in self.sessions:
            raise UserError(
                f"no sampling session {sampler_id!r} (a session keeps its {self.cfg.max_samplers_per_session} "
                "newest samplers: create it again from its path)"
            )
        found[0].seen = time.monotonic()
        return found

    async def get_sampler(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        _, sampler = self._sampler(request.path_params["sampler_id"], owner)
        return {"sampler_id": sampler.id, "base_model": self.base_model, "model_path": sampler.model_path}

    async def asample(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        req = parse(types.SampleRequest, body)
        if req.model_path is not None or req.base_model is not None:
            raise UserError("sample: model_path and base_model are not taken; give a sampling_session_id")
        session, sampler = self._sampler(req.sampling_session_id, owner)
        if not 0 < req.num_samples <= self.cfg.max_samples:
            raise UserError(f"sample: num_samples {req.num_samples}; 1 to {self.cfg.max_samples} (tinker.max_samples)")
        tokens = prompt_tokens(req, self.vocab, self.max_len)
        args = sampling_args(req, self.max_len - len(tokens), self.max_tokens, self.vocab)
        if args["seed"] is None and self.sample_seeds is not None:
            args["seed"] = self.sample_seeds.getrandbits(31)

        async def run() -> bytes:
            out = await self.gen.generate.route(tokens, n=req.num_samples, sampling=args, policy=sampler.policy)
            return encode_sample(out, req)

        key = ("sample", sampler.id, req.seq_id if req.seq_id is not None else uuid.uuid4().hex)
        handle = self._submit(session, key, run)
        return {**handle, "sample_sequence_ids": [f"{handle['request_id']}:{i}" for i in range(req.num_samples)]}

    # ---- checkpoints -----------------------------------------------------------------

    def _owned(self, owner: str, run_id: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
        """`owner`'s checkpoints (their directories and metadata), those expired left out."""
        found = []
        for meta_file in sorted(self.root.glob(f"{run_id or '*'}/*/*/{META}")):
            meta = self._read_meta(meta_file)
            if meta is None or meta.get("owner") != owner:  # another's, or one no listing can show
                continue
            if not _expired(meta):
                found.append((meta_file.parent, meta))
        return found

    def _check_room(self, owner: str, where: Path) -> None:
        """A UserError when `owner`'s checkpoints, other than the one at `where` (a save replaces
        it), are as many or hold as many bytes as a key may keep."""
        others = [w for w, _ in self._owned(owner) if w != where]
        free = "delete some (RestClient.delete_checkpoint) or save with a ttl_seconds"
        if len(others) >= self.cfg.max_checkpoints_per_key:
            raise UserError(
                f"{len(others)} checkpoints are saved under this key "
                f"(tinker.max_checkpoints_per_key: {self.cfg.max_checkpoints_per_key}); {free}"
            )
        held = sum(_size(w) for w in others)
        if held >= self.cfg.max_checkpoint_bytes_per_key:
            raise UserError(
                f"this key's checkpoints hold {held} bytes "
                f"(tinker.max_checkpoint_bytes_per_key: {self.cfg.max_checkpoint_bytes_per_key}); {free}"
            )

    def _checkpoints(self, owner: str, run_id: str | None = None) -> list[dict[str, Any]]:
        out = []
        for where, meta in self._owned(owner, run_id):
            kind, model_id = where.parent.name, where.parent.parent.name
            out.append(
                {
                    "checkpoint_id": f"{kind}/{where.name}",
                    "checkpoint_type": KINDS[kind],
                    "time": _iso(meta["time"]),
                    "tinker_path": f"tinker://{model_id}/{kind}/{where.name}",
                    "size_bytes": _size(where),
                    "public": False,
                    "expires_at": _iso(meta.get("expires")),
                }
            )
        return out

    async def list_run_checkpoints(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        run_id = request.path_params["run_id"]
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}", run_id):
            raise UserError(f"no training run {run_id!r}")
        return {"checkpoints": await asyncio.to_thread(self._checkpoints, owner, run_id), "cursor": None}

    def _addressed(self, request: Request, owner: str) -> tuple[Path, dict[str, Any]]:
        """The caller's checkpoint its URL names (`.../checkpoints/KIND/NAME`), and its metadata."""
        p = request.path_params
        return self._resolve(f"tinker://{p['run_id']}/{p['kind']}/{p['name']}", owner, p["kind"], to_load=False)

    async def delete_checkpoint(self, request: Request, owner: str, body: bytes) -> Response:
        """RestClient.delete_checkpoint: the caller's checkpoint, gone."""
        where, _ = self._addressed(request, owner)
        await asyncio.to_thread(shutil.rmtree, where, True)
        return Response(status_code=204)

    async def set_checkpoint_ttl(self, request: Request, owner: str, body: bytes) -> Response:
        """RestClient.set_checkpoint_ttl_from_tinker_path: the caller's checkpoint expires
        `ttl_seconds` from now (null: it is kept)."""
        where, meta = self._addressed(request, owner)
        fields = json.loads(body or b"null")
        if not isinstance(fields, dict) or set(fields) != {"ttl_seconds"}:
            raise UserError('the body is {"ttl_seconds": seconds, or null}')
        ttl = fields["ttl_seconds"]
        if ttl is not None and type(ttl) is not int:
            raise UserError(f"ttl_seconds: {ttl!r}; a whole number of seconds, or null")
        meta["expires"] = time.time() + self._ttl(ttl) if ttl is not None else None
        try:
            _store_meta(where, meta)
        except FileNotFoundError:  # deleted (or expired and reaped) since it was found
            p = request.path_params
            raise UserError(f"no checkpoint 'tinker://{p['run_id']}/{p['kind']}/{p['name']}'") from None
        return Response(status_code=204)

    async def list_checkpoints(self, request: Request, owner: str, body: bytes) -> dict[str, Any]:
        found = await asyncio.to_thread(self._checkpoints, owner)  # the disk's, off the event loop
        limit, offset = (_count(request.query_params.get(k, str(d)), k) for k, d in (("limit", 100), ("offset", 0)))
        page = found[offset : offset + limit]
        return {"checkpoints": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}
