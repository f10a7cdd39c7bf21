"""Server mode: an OpenAI-compatible HTTP gateway over the generator service that records the
exact tokens every session sampled.

    gateway = await Gateway.start(gen, model_dir, GatewayConfig())
    session = gateway.open_session()                        # the agent's API key
    client = gateway.client(session)                        # an openai.AsyncOpenAI on the gateway
    ...                                                     # the agent calls the API as in production
    record = await gateway.finish(session)                  # each call's prompt ids, sampled ids, logprobs, versions
    episodes = record.samples()                             # the token sequences to train on

vLLM's own OpenAI server does the HTTP work (request models and validation, chat templates,
tool and reasoning parsers, `n`, logprobs, streaming, error responses). It runs here over
`ServiceEngineClient`, an EngineClient whose `generate` sends vLLM's rendered prompt to one
generator replica (the session's, for its prefix cache) and streams that replica's vLLM outputs
back through a Monarch port. The gateway adds what a training system needs: sessions (the bearer
token), the recording, bounds on sessions and requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hmac
import json
import logging
import signal
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import openai
import torch

from forge.http_bounds import bounded_http
from forge.schema import ADAPTER_CONFIG
from forge.types import Episode, logprob_temperature
from services.generator import Generator, engine_args
from services.schema import GatewayConfig, GeneratorConfig

log = logging.getLogger("forge")

PUBLIC_PATHS = ("/health", "/ping", "/version")  # answered without a key
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")  # counted against max_inflight
# vLLM's app has more routes that generate (/v1/responses, /v1/messages, /invocations, ...);
# they would skip the session record and the limits below, so only these are served.
ROUTES = (*PUBLIC_PATHS, *GENERATION_PATHS, "/v1/models", "/tokenize", "/detokenize")


# ---- what a session recorded --------------------------------------------------------


@dataclass
class Turn:
    """One call of a session: the prompt the gateway sent, and for each choice the tokens
    sampled, their logprobs and why it finished; the policy versions it was admitted and
    finished under."""

    prompt_ids: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str | None]
    versions: tuple[int, int]
    # Each choice's routing record (a MoE with routing replay): [prompt + its tokens, layers, top_k].
    routed_experts: list[Any] | None = None
    temperature: float = 1.0  # the request's sampling temperature (0: greedy)


@dataclass
class SessionRecord:
    session: str
    turns: list[Turn] = field(default_factory=list)

    def samples(self) -> list[Episode]:
        """The turns as token sequences to train on, the model's own tokens never re-tokenized:
        a turn whose prompt extends a sequence (its earlier prompts and sampled tokens, token for
        token) continues it; any other (the agent edited its history, the template rendered an
        earlier turn differently) starts a sample of its own (`new_sample_at` lists them). Each
        sequence is extended by one choice per turn; other choices become samples of their own.
        Samples that are the turns in a line, cut (each turn once, in order), are marked as parts
        of one episode (`Episode.part`): a critic's returns run on from one to the next."""
        sequences = self._sequences()
        episodes = [s.episode() for s in sequences]
        if len(episodes) > 1 and [t for s in sequences for t in s.turns] == list(range(len(self.turns))):
            episode = uuid.uuid4().hex  # not the session: that is the agent's API key
            for k, e in enumerate(episodes):
                e.part = (episode, k)
        return episodes

    @property
    def new_sample_at(self) -> list[int]:
        """The turns (after the first) that did not extend a sequence: where a sample starts."""
        return sorted({s.turns[0] for s in self._sequences()} - {0})

    def _sequences(self) -> list[_Sequence]:
        done: list[_Sequence] = []
        for t, turn in enumerate(self.turns):
            extended = set()
            for c in range(len(turn.token_ids)):
                tip = next(
                    (s for s in reversed(done) if id(s) not in extended and s.continued_by(turn.prompt_ids)), None
                )
                if tip is None:
                    tip = _Sequence()
                    done.append(tip)
                tip.add(t, turn, c)
                extended.add(id(tip))
        return done


@dataclass
class _Sequence:
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    # Each token's routing, as the first turn that computed it recorded it (a MoE with routing
    # replay); dropped for the whole sequence if one of its turns has no record.
    routing: torch.Tensor | None = None
    routed: bool = True

    def continued_by(self, prompt: list[int]) -> bool:
        return len(prompt) >= len(self.tokens) and prompt[: len(self.tokens)] == self.tokens

    def add(self, t: int, turn: Turn, choice: int) -> None:
        start = len(self.tokens)
        new_prompt = turn.prompt_ids[start:]
        sampled = turn.token_ids[choice]
        self.tokens += new_prompt + sampled
        self.mask += [0] * len(new_prompt) + [1] * len(sampled)
        self.logprobs += [0.0] * len(new_prompt) + turn.logprobs[choice]
        self.temperatures += [1.0] * len(new_prompt) + [logprob_temperature(turn.temperature)] * len(sampled)
        self.versions.append(turn.versions[0])
        self.turns.append(t)
        self._route(turn.routed_experts[choice] if turn.routed_experts else None, start)

    def _route(self, record: torch.Tensor | None, start: int) -> None:
        """Append a turn's record of its new tokens; the earlier tokens it computed (those the
        prefix cache did not hold) fill what the earlier turns lack (-1)."""
        self.routed = self.routed and record is not None
        if not self.routed:
            self.routing = None
            return
        earlier = (
            record[:start] if self.routing is None else torch.where(self.routing < 0, record[:start], self.routing)
        )
        self.routing = torch.cat([earlier, record[start:]])

    def episode(self) -> Episode:
        # Staleness is judged by the oldest turn.
        return Episode(
            tokens=self.tokens,
            loss_mask=self.mask,
            gen_logprobs=self.logprobs,
            policy_version=min(self.versions),
            routed_experts=self.routing,
            temperatures=self.temperatures if any(t != 1.0 for t in self.temperatures) else None,
        )


@dataclass
class _Session:
    id: str
    target: Any  # forge.service.Session: every call on one generator replica
    record: SessionRecord
    last_used: float = field(default_factory=time.monotonic)
    inflight: int = 0  # HTTP requests
    generating: int = 0  # generations (a request makes one per prompt)
    tokens: int = 0  # recorded: each turn's prompt and sampled tokens
    requests: set[str] = field(default_factory=set)  # its generations' ids, while they run
    closed: bool = False  # finished: nothing more is recorded

    def full(self, cfg: GatewayConfig, pending: int) -> str | None:
        """Why the session may start no more work, with `pending` turns on the way; else None."""
        if len(self.record.turns) + pending >= cfg.max_turns:
            return f"the session has recorded {cfg.max_turns} turns (gateway max_turns): finish it"
        if self.tokens >= cfg.max_session_tokens:
            return f"the session has recorded {self.tokens} tokens (gateway max_session_tokens): finish it"
        return None

    def record_turn(self, turn: Turn) -> None:
        if self.closed:  # a generation `finish` stopped: its record was returned without it
            return
        self.record.turns.append(turn)
        self.tokens += len(turn.prompt_ids) + sum(map(len, turn.token_ids))


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("forge_gateway_session", default=None)


# ---- vLLM's server over the generator service ---------------------------------------


class _Sampled:
    """A request's samples as its RequestOutputs show them (each one's tokens so far, or with
    `delta`, only the new ones), for the session's record."""

    def __init__(self, delta: bool):
        self.delta = delta
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.finish: dict[int, str | None] = {}

    def add(self, out: Any) -> None:
        for c in out.outputs:
            lps = _sampled_logprobs(c.logprobs, c.token_ids)
            before = (self.tokens.get(c.index, []), self.logprobs.get(c.index, [])) if self.delta else ([], [])
            self.tokens[c.index] = before[0] + list(c.token_ids)
            self.logprobs[c.index] = before[1] + lps
            self.finish[c.index] = c.finish_reason

    def turn(self, prompt_ids: list[int], versions: list[int], routing: list[Any], temperature: float) -> Turn:
        n = sorted(self.tokens)
        return Turn(
            prompt_ids=list(prompt_ids),
            token_ids=[self.tokens[i] for i in n],
            logprobs=[self.logprobs[i] for i in n],
            finish_reasons=[self.finish[i] for i in n],
            versions=tuple(versions),
            routed_experts=routing if any(r is not None for r in routing) else None,
            temperature=temperature,
        )


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """Each sampled token's logprob, from vLLM's logprobs of a sample's tokens."""
    from vllm.logprobs import FlatLogprobs

    if isinstance(logprobs, FlatLogprobs):  # vLLM puts the sampled token first at each position
        return [logprobs.logprobs[i] for i in logprobs.start_indices]
    return [lp[t].logprob for lp, t in zip(logprobs or [], token_ids)]


class _ServiceEngine:
    """vLLM's EngineClient (the class `_engine_client_class` makes of it), served by forge's
    generator service instead of an engine in this process. Only what an OpenAI server uses
    is implemented; the rest belongs to forge (weights, sleep, profiling) and says so."""

    def __init__(self, gateway: Gateway, vllm_config: Any):
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.gateway, self.gen = gateway, gateway.gen
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self._targets: dict[str, Any] = {}  # request id -> the replica session running it

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, lora_request: Any = None, **_: Any
    ) -> AsyncIterator[Any]:
        from monarch.actor import Channel
        from vllm.sampling_params import RequestOutputKind

        session = _SESSION.get()
        if session is not None:  # counted here, per generation: a request may make many
            _refuse_if_full(session, self.gateway.cfg)
        target = session.target if session is not None else self.gen.pinned()
        params = sampling_params.clone()
        if params.logprobs is None:  # the sampled token's logprob, always recorded; asked ones as asked
            params.logprobs = 0
        # A few lists for all positions in place of a dict and a Logprob per token: less to pickle
        # on the generator's side and to unpickle on this one (py-spy on `forge bench gateway`).
        params.flat_logprobs = True
        delta = params.output_kind == RequestOutputKind.DELTA
        # A request that is not streamed (FINAL_ONLY) is one call whose result carries its output;
        # a streamed one's outputs come through a port as vLLM yields them.
        port, receiver = Channel.open() if params.output_kind != RequestOutputKind.FINAL_ONLY else (None, None)
        call = asyncio.ensure_future(target.stream.route(port, dict(prompt), params, request_id, lora_request))
        self._targets[request_id] = target
        sampled = _Sampled(delta)
        ended = False
        if session is not None:
            session.generating += 1
            session.requests.add(request_id)
        try:
            yielded = False
            while receiver is not None:
                out = await _next(receiver, call)
                if out is None:
                    break
                if out == "start":  # the first attempt, or a retry after its replica died
                    if yielded and delta:
                        raise RuntimeError("the generator replica died while streaming; retry the request")
                    sampled = _Sampled(delta)
                    continue
                sampled.add(out)
                yielded = True
                yield out
            *versions, routing, final = await call
            ended = True
            if final is not None:
                sampled.add(final)
                yield final
        finally:
            self._targets.pop(request_id, None)
            if session is not None:
                session.generating -= 1
                session.requests.discard(request_id)
            if not ended:  # the client went away (or the call failed): vLLM must stop too
                call.cancel()
                await asyncio.shield(_quietly(target.abort.route(request_id)))
        if session is not None:
            session.record_turn(sampled.turn(prompt["prompt_token_ids"], versions, routing, params.temperature))

    async def abort(self, request_id: str | Any) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            if rid in self._targets:
                await self._targets[rid].abort.route(rid)

    async def check_health(self) -> None:
        if not self.gen.healthy():
            raise RuntimeError("no healthy generator replica")

    @property
    def is_running(self) -> bool:
        return bool(self.gen.healthy())

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the generator service has no healthy replica")

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        pass

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        return True  # each replica resets its own when its weights change

    async def reset_mm_cache(self) -> None:
        pass

    async def reset_encoder_cache(self) -> None:
        pass

    async def is_sleeping(self) -> bool:
        return False

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        pass

    def _not_here(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "forge's gateway serves generation only: weights, sleep, LoRA and profiling belong to the generator service"
        )

    encode = notify_kv_transfer_request_rejected = start_profile = stop_profile = _not_here

    async def add_lora(self, lora_request: Any) -> bool:
        """A named adapter (`--lora NAME=DIR`): every replica loads it now, so a bad one fails at start."""
        return all(await self.gen.add_lora.fanout(lora_request))

    sleep = release_kv_cache_memory = wake_up = pause_generation = resume_generation = _not_here


def _engine_client_class() -> type:
    """vLLM's EngineClient with `_ServiceEngine`'s methods (first in the MRO, so they implement
    its abstract ones); made on first use, as importing vLLM costs seconds."""
    from vllm.engine.protocol import EngineClient

    return type("ServiceEngineClient", (_ServiceEngine, EngineClient), {"__module__": __name__})


def _refuse_if_full(session: _Session, cfg: GatewayConfig) -> None:
    """A 429 (vLLM's server answers it as one) when the session may start no more generations;
    a 401 once it is finished (a request admitted before `finish` that reaches vLLM after it
    would sample for a record that no longer takes it)."""
    from vllm.exceptions import GracefulHTTPError

    if session.closed:
        raise GracefulHTTPError("the session is finished: its key is refused from now", HTTPStatus.UNAUTHORIZED)
    full = session.full(cfg, session.generating)
    if full is not None:
        raise GracefulHTTPError(full, HTTPStatus.TOO_MANY_REQUESTS)


async def _next(receiver: Any, call: asyncio.Future) -> Any:
    """The next message of the stream, or the call's error if it failed first."""
    got = asyncio.ensure_future(receiver.recv())
    done, _ = await asyncio.wait([got, call], return_when=asyncio.FIRST_COMPLETED)
    if got in done:
        return got.result()
    if call.exception() is not None:
        got.cancel()
        raise call.exception()
    return await got  # the call returned: its last messages are on the way


def gateway_client(base_url: str, api_key: str, ssl_context: ssl.SSLContext) -> openai.AsyncOpenAI:
    """An `openai.AsyncOpenAI` on the gateway at `base_url` under `api_key`, without retries.
    `ssl_context`: one per process (httpx would load the CA bundle for every client)."""
    # aiohttp as the transport (the openai client's own option, `DefaultAioHttpClient`): its
    # HTTP parsing is C, where httpx's is Python: up to 0.5 ms of CPU less a call (`forge bench
    # gateway`, its gateway_inproc side against gateway_httpx).
    http = openai.DefaultAioHttpClient(verify=ssl_context, trust_env=False)  # loopback: no proxy
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as e:  # the replica may be gone; nothing is left to stop then
        log.debug("forge: abort failed: %s", e)


def _error(status: int, message: str, kind: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


async def _respond(send: Any, refusal: tuple[int, bytes]) -> None:
    status, body = refusal
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Any, limit: int) -> bytes | None:
    """The request's body, or None once it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """`receive` for the app: the body read already, then the client's own messages (a
    streaming response waits on them to see the client go)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


# Options refused unless at their default (400 naming the field): each multiplies a request's work
# past what max_n and max_tokens bound, or makes generations the session's record cannot hold.
UNSUPPORTED = {
    "use_beam_search": "beam search runs a generation per beam and step",
    "best_of": "best_of samples choices that are not returned",
    "prompt_logprobs": "prompt logprobs cost a distribution per prompt token",
    "echo": "echo computes prompt logprobs",
    "prompt_embeds": "a prompt of embeddings has no token ids to record",
    "kv_transfer_params": "disaggregated serving is not forge's",
    "ec_transfer_params": "disaggregated serving is not forge's",
    "vllm_xargs": "vLLM extensions are not forge's",
    # vLLM gathers these logprobs for the whole batch in place of its other requests' top logprobs
    "logprob_token_ids": "its logprobs would take the place of other requests' top logprobs",
}


@functools.cache
def _request_models() -> dict[str, type]:
    """The pydantic models vLLM parses each generation route's body with (imported on first use:
    importing vLLM costs seconds)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def _checked_request(
    body: bytes, path: str, cfg: GatewayConfig, default_max_tokens: int
) -> tuple[bytes, tuple[int, bytes] | None]:
    """A generation request's body within the per-request limits, checked on the values vLLM's
    own request model parses ("17" and 17.0 are 17 to it), with `default_max_tokens` where it
    would sample to the end of the context, and without a client-chosen `request_id` (ids key
    the generator's requests: the server makes them); else a 400. A body vLLM would refuse goes
    on as is, for vLLM to name what is wrong (one its validators choke on is a 400 here)."""
    try:
        request = json.loads(body)
        values = _as_parsed(request, path)
    except ValueError:  # not JSON, or not a valid request (pydantic's ValidationError is one)
        return body, None
    except RecursionError:  # JSON nested deeper than any parser here follows
        return body, _error(400, "the request body is not valid JSON (nested too deeply)", "invalid_request_error")
    except (TypeError, AttributeError) as e:  # a validator of vLLM's request model given a JSON type it does not expect
        return body, _error(400, f"the request body is not a valid {path} request: {e}", "invalid_request_error")
    refusal = _refused_option(values, cfg) or _over_limits(values, cfg)
    if refusal is not None:
        return body, refusal
    asked = values.get("max_completion_tokens")
    if (asked if asked is not None else values.get("max_tokens")) is None:
        request["max_tokens"] = default_max_tokens
    request.pop("request_id", None)
    return json.dumps(request).encode(), None


def _as_parsed(request: Any, path: str) -> dict[str, Any]:
    """The values of the fields the limits read, as vLLM's request model parses them. A chat
    request whose fields are already what the parse gives (no refused option named, counts as
    JSON integers) is read as sent, without the parse vLLM's route makes again (0.4 ms of the
    controller's CPU a call, `py-spy` on `forge bench gateway`)."""
    counts = ("n", "max_tokens", "max_completion_tokens")
    plain = (
        path == "/v1/chat/completions"
        and isinstance(request, dict)
        and "messages" in request
        and not request.keys() & UNSUPPORTED.keys()
        and all(request.get(k) is None or type(request[k]) is int for k in counts)
    )
    return request if plain else _parsed_fields(request, path)


def _parsed_fields(request: Any, path: str) -> dict[str, Any]:
    """The fields of `request` as vLLM's request model for `path` parses them."""
    from vllm.exceptions import VLLMClientError

    try:
        parsed = _request_models()[path].model_validate(request)
    except VLLMClientError as e:  # a validator's own refusal, which pydantic does not wrap: invalid all the same
        raise ValueError(str(e)) from None
    # `vars`: reading the deprecated max_tokens attribute would warn.
    return {**vars(parsed), **(parsed.model_extra or {})}


def _refused_option(values: dict[str, Any], cfg: GatewayConfig) -> tuple[int, bytes] | None:
    taken = ("echo", "prompt_logprobs") if cfg.prompt_logprobs else ()
    for key, why in UNSUPPORTED.items():
        if key in taken:
            continue
        value = values.get(key)
        if value is not None and value is not False:  # 0 is not the default: prompt_logprobs=0 computes them
            return _error(400, f"'{key}' is not supported by forge's gateway ({why})", "invalid_request_error")
    return None


def _over_limits(values: dict[str, Any], cfg: GatewayConfig) -> tuple[int, bytes] | None:
    prompt = values.get("prompt") if "messages" not in values else None  # a chat request's extra field: not its prompts
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    choices = (values.get("n") or 1) * prompts
    if choices > cfg.max_n:
        return _error(
            400, f"{choices} choices (n × prompts) exceed the gateway's max_n ({cfg.max_n})", "invalid_request_error"
        )
    for key in ("max_tokens", "max_completion_tokens"):
        asked = values.get(key)
        if isinstance(asked, int) and asked > cfg.max_tokens:
            return _error(
                400, f"{key}={asked} exceeds the gateway's max_tokens ({cfg.max_tokens})", "invalid_request_error"
            )
    return None


class _Gate:
    """ASGI middleware in front of vLLM's app: only forge's routes; the bearer token names the
    session (or is the API key); requests past `max_inflight` (or a session's limits) are
    refused (429) instead of queued without bound, and bodies past the request limits (400)."""

    def __init__(self, app: Any, gateway: Gateway):
        self.app, self.gateway = app, gateway
        self.inflight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # the server's own start and stop, not a client's
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # websockets: none of forge's routes is one
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "websockets are not served here"})
            return None
        if scope["path"] not in ROUTES:
            served = ", ".join(ROUTES)
            return await _respond(
                send, _error(404, f"{scope['path']} is not served here (served: {served})", "not_found_error")
            )
        if scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        # any bytes a client sends (HTTP allows obs-text: no key has them); the scheme in any case (RFC 9110)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode(errors="replace")
        scheme, _, token = auth.partition(" ")
        session, refusal = self.gateway._admit(token.strip() if scheme.lower() == "bearer" else None)
        generating = scope["path"] in GENERATION_PATHS
        if refusal is None and generating:
            refusal = self._capacity(session)
        if refusal is not None:
            return await _respond(send, refusal)
        # Its place in the limits is taken now, before its body arrives (checked and taken with
        # no wait between: no request passes while another's body is on its way).
        self.inflight += generating
        if session is not None:
            session.inflight += 1
        try:
            await self._checked_forward(scope, receive, send, session, generating)
        finally:
            self.inflight -= generating
            if session is not None:
                session.inflight -= 1
                session.last_used = time.monotonic()

    def _capacity(self, session: _Session | None) -> tuple[int, bytes] | None:
        cfg = self.gateway.cfg
        if self.inflight >= cfg.max_inflight:
            return _error(
                429,
                f"more than {cfg.max_inflight} requests in flight (gateway max_inflight); retry later",
                "rate_limit_error",
            )
        if not self.gateway.gen.healthy():
            return _error(503, "no healthy generator replica", "service_unavailable")
        if session is not None and session.inflight >= cfg.max_session_inflight:
            return _error(
                429,
                f"the session has {session.inflight} requests in flight (gateway max_session_inflight)",
                "rate_limit_error",
            )
        full = session.full(cfg, session.inflight) if session is not None else None
        return _error(429, full, "rate_limit_error") if full is not None else None

    async def _checked_forward(
        self, scope: dict, receive: Any, send: Any, session: _Session | None, generating: bool
    ) -> None:
        """Read the body within the request limits, then hand the request to vLLM's app."""
        body = await _read_body(receive, self.gateway.cfg.max_body_bytes)
        refusal = None
        if body is None:
            limit = self.gateway.cfg.max_body_bytes
            refusal = _error(
                400, f"the request body exceeds the gateway's max_body_bytes ({limit})", "invalid_request_error"
            )
        elif generating:
            body, refusal = _checked_request(body, scope["path"], self.gateway.cfg, self.gateway.default_max_tokens)
        if refusal is not None:
            return await _respond(send, refusal)
        # vLLM names a request by the client's X-Request-Id when there is one: drop it.
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"x-request-id"]}
        token_ctx = _SESSION.set(session)
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            _SESSION.reset(token_ctx)


class Gateway:
    """The OpenAI API (vLLM's server) over a Generator service, on `base_url`."""

    def __init__(self, gen: Any, model: str, cfg: GatewayConfig, engine_args: Any):
        self.gen, self.model, self.cfg = gen, str(model), cfg
        self.engine_args = engine_args
        self.sessions: dict[str, _Session] = {}
        self.base_url = ""
        # httpx makes an SSL context per client (loading the CA bundle), even for http://: a client
        # per episode spent half the controller's CPU there. Each client keeps a connection pool of
        # its own: one pool for 64 episodes spent 9% of it scanning its connections per request.
        self._ssl = ssl.create_default_context()
        self.adapters: dict[str, str] = {}  # named LoRA adapters served beside the base model
        self.chat_template_kwargs: dict[str, Any] = {}

    @classmethod
    async def start(
        cls, gen: Any, model: str | Path, cfg: GatewayConfig | None = None, generator_cfg: Any = None
    ) -> Gateway:
        """Serve `gen` (a Generator service on `model`, made with `generator_cfg`) on
        cfg.host:cfg.port; returns once it accepts connections."""
        cfg = cfg or GatewayConfig()
        cfg.validate()
        generator_cfg = generator_cfg or GeneratorConfig()
        self = cls(gen, str(model), cfg, engine_args(generator_cfg, str(model)))
        self.adapters = generator_cfg.adapters
        self.chat_template_kwargs = generator_cfg.chat_template_kwargs  # as the generator renders chat prompts
        await self._serve()
        return self

    async def _serve(self) -> None:
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        # vLLM's server options; its engine options come from the generator's config (vllm_config).
        name = self.cfg.served_model_name or Path(self.model).name
        argv = [
            "--model",
            self.model,
            "--served-model-name",
            name,
            "--disable-log-stats",
            "--disable-uvicorn-access-log",
        ]
        if self.cfg.chat_template:
            argv += ["--chat-template", self.cfg.chat_template]
        if self.cfg.tool_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", self.cfg.tool_parser]
        if self.cfg.reasoning_parser:
            argv += ["--reasoning-parser", self.cfg.reasoning_parser]
        if self.chat_template_kwargs:
            argv += ["--default-chat-template-kwargs", json.dumps(dict(self.chat_template_kwargs))]
        if self.adapters:  # the OpenAI `model` field names one of them, or the base model
            argv += ["--lora-modules", *(f"{name}={path}" for name, path in self.adapters.items())]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        vllm_config = await asyncio.to_thread(self.engine_args.create_engine_config)
        self.engine_client = _engine_client_class()(self, vllm_config)
        app = build_app(args, supported_tasks=("generate",), model_config=vllm_config.model_config)
        # vLLM's per-request middleware does nothing the gateway serves (Prometheus's HTTP metrics
        # for a /metrics route it refuses, elastic-EP scaling, CORS with no origin allowed) and
        # cost its Python on every call (py-spy on `forge bench gateway`). build_app has already
        # built the stack from them: rebuild it.
        app.user_middleware = []
        app.middleware_stack = app.build_middleware_stack()
        # Starlette tries every route of the app in turn for each request; `_Gate` passes only ROUTES on.
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) in ROUTES]
        await init_app_state(self.engine_client, app.state, args, supported_tasks=("generate",))
        sock = socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        host, port = sock.getsockname()[:2]
        self.base_url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
        self._server = uvicorn.Server(
            uvicorn.Config(
                _Gate(app, self),
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=2,
                proxy_headers=False,  # nothing here reads the client's address
                http=bounded_http(self.cfg.request_deadline_s, self.cfg.max_connections),
            )
        )
        # The gateway serves inside a run, whose process owns Ctrl-C (it saves a checkpoint):
        # uvicorn would take SIGINT for itself and close the gateway under the run's episodes.
        self._server.capture_signals = contextlib.nullcontext
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._reaper = asyncio.create_task(self._reap())
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.02)

    def client(self, api_key: str = "-") -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` on this gateway whose API key is `api_key` (a session, for an
        agent's episode); close it when done. No retries: a failed call is the episode's to handle."""
        return gateway_client(self.base_url, api_key, self._ssl)

    @property
    def default_max_tokens(self) -> int:
        """gateway.default_max_tokens within the model's context (vLLM refuses a max_tokens past it)."""
        return min(self.cfg.default_max_tokens, self.engine_client.model_config.max_model_len)

    @property
    def model_name(self) -> str:
        """The name clients ask for (`model=`)."""
        return self.cfg.served_model_name or Path(self.model).name

    # ---- sessions --------------------------------------------------------------------

    def open_session(self) -> str:
        """A new session (its id is the API key its client sends), pinned to one generator
        replica. Raises RuntimeError when `max_sessions` are open."""
        if not self.cfg.sessions:
            raise RuntimeError("this gateway runs without sessions (GatewayConfig.sessions=False)")
        if len(self.sessions) >= self.cfg.max_sessions:
            raise RuntimeError(f"{len(self.sessions)} sessions are open (gateway max_sessions); finish some first")
        sid = f"forge-{uuid.uuid4().hex}"
        self.sessions[sid] = _Session(sid, self.gen.pinned(), SessionRecord(sid))
        return sid

    async def finish(self, session: str, timeout_s: float = 30.0) -> SessionRecord:
        """Close `session` (its key is refused from now) and return what it recorded, once its
        calls in flight end; those still generating after `timeout_s` are stopped, unrecorded."""
        s = self.sessions.pop(session, None)
        if s is None:
            raise KeyError(f"no open session {session!r} (finished, timed out or never opened)")
        deadline = time.monotonic() + timeout_s
        while s.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        s.closed = True
        for request_id in list(s.requests):
            await _quietly(s.target.abort.route(request_id))
        return s.record

    def _admit(self, token: str | None) -> tuple[_Session | None, tuple[int, bytes] | None]:
        if not self.cfg.sessions:
            if self.cfg.api_key is not None and not hmac.compare_digest(
                (token or "").encode(), self.cfg.api_key.encode()
            ):
                return None, _error(401, "invalid API key", "authentication_error")
            return None, None
        s = self.sessions.get(token or "")
        if s is None:
            return None, _error(
                401,
                "unknown session: send an open session's id as the API key (Authorization: Bearer <session>)",
                "authentication_error",
            )
        s.last_used = time.monotonic()
        return s, None

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.cfg.session_timeout_s / 2))
            now = time.monotonic()
            for sid, s in list(self.sessions.items()):
                if not s.inflight and now - s.last_used > self.cfg.session_timeout_s:
                    log.warning(
                        "forge: gateway session %s idle for %.0f s: closed, %d turns dropped",
                        sid,
                        now - s.last_used,
                        len(s.record.turns),
                    )
                    del self.sessions[sid]

    async def shutdown(self) -> None:
        self._reaper.cancel()
        self._server.should_exit = True
        await asyncio.gather(self._task, self._reaper, return_exceptions=True)


def model_dir(path: str | Path) -> Path:
    """An HF model directory, or a run directory whose exported `model/` is one (or a LoRA adapter)."""
    path = Path(path)
    for d in (path, path / "model"):
        if (d / "config.json").is_file() or (d / ADAPTER_CONFIG).is_file():
            return d
    raise FileNotFoundError(f"{path}: neither an HF model directory (config.json) nor a run directory with model/")


def base_of(adapter: Path) -> Path:
    """The base model a PEFT adapter directory was trained on (its `base_model_name_or_path`)."""
    return model_dir(json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])


async def serve(model: str | Path, cfg: GatewayConfig, generator_cfg: Any, replicas: int = 1) -> None:
    """`forge serve`: a Generator service of `replicas` on `model` behind a gateway without
    sessions, until SIGINT or SIGTERM."""
    cfg.validate()  # before any engine starts
    model = model_dir(model)
    name = model.parent.name if model.name == "model" else model.name  # a run's policy: the run's name
    if (model / ADAPTER_CONFIG).is_file():  # a LoRA run's adapter: served on the base it was trained on
        generator_cfg.adapters = {name: str(model), **generator_cfg.adapters}
        model = base_of(model)
    elif cfg.served_model_name is None:
        cfg.served_model_name = name
    gen = await Generator.options(replicas=replicas).as_service(str(model), generator_cfg)
    named = ", ".join(f"{n!r}" for n in generator_cfg.adapters)
    try:
        gw = await Gateway.start(gen, model, cfg, generator_cfg)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        print(
            f"forge serve: model {gw.model_name!r}{f' and LoRA adapters {named}' if named else ''} "
            f"({replicas} replica(s)) on {gw.base_url}; Ctrl-C stops",
            flush=True,
        )
        await stop.wait()
        await gw.shutdown()
    finally:
        await gen.shutdown()
