"""Generator service: stock vLLM (`AsyncLLM`) behind a forge service.

    gen = await Generator.options(replicas=2).as_service(path, GeneratorConfig(sampling=SamplingConfig(temperature=0.8)))
    completions = await gen.generate.route("rev abc=", n=8)      # one GRPO group
    await gen.load_weights.fanout(state_dict, version=3)         # staged, then swapped in; no restart

With `weights_from=WeightStore(...)`, each replica loads the versions a WeightSync
(forge/weight_sync.py) announces, from the store, while it keeps generating (and a respawned
replica starts on the store's latest). With `lora=LoRAConfig(rank=8)` a version is a LoRA
adapter, loaded into vLLM beside the base weights, which never move.

Each replica runs one AsyncLLM (continuous batching): concurrent `generate` calls are
batched by vLLM. Every Completion carries its token ids, the logprob of each sampled token
under the sampling distribution (`processed_logprobs`: after temperature/top-p/top-k, the
distribution the trainer's importance ratio needs), and the policy versions it was
generated under.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import gc
import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
import typing
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge import logs
from forge.actor import ForgeActor
from forge.config import ConfigError, require_file
from forge.lora import adapter_rank, write_adapter
from forge.metrics import Reduce, record_metric
from forge.schema import LoRAConfig
from forge.shm import run_dir, write_safetensors
from forge.types import Completion
from services.schema import GeneratorConfig

log = logging.getLogger("forge")
ABORTS_KEPT = 4096  # aborted stream ids a replica remembers (see Generator._aborted)


def _lora_args(cfg: GeneratorConfig, loras: list[LoRAConfig]) -> dict[str, Any]:
    """vLLM's LoRA options for the policies' adapters (`loras`, one per LoRA policy) and the named ones."""
    from vllm.config.lora import MaxLoRARanks

    ranks = [adapter_rank(p) for p in cfg.adapters.values()]
    loras = [lora for lora in loras if lora.enabled]
    ranks += [lora.rank for lora in loras]
    if not ranks:
        return {}
    fits = [r for r in typing.get_args(MaxLoRARanks) if r >= max(ranks)]
    if not fits:
        most = max(typing.get_args(MaxLoRARanks))
        raise ConfigError(f"config key 'trainer.lora.rank' (or an adapter's r): {max(ranks)} > {most}, vLLM's largest")
    # Each policy's: the version requests are admitted under, and the one before, still
    # finishing the requests admitted under it.
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": len(cfg.adapters) + 2 * len(loras)}


def engine_env(cfg: GeneratorConfig) -> dict[str, str]:
    """What the environment of vLLM's engine-core process must hold (it inherits it when the
    engine starts): `cpu_threads`, on CPU. Its CPU platform keeps the multiprocess executor
    unless multiprocessing is off."""
    if not cfg.cpu_threads or torch.accelerator.is_available():
        return {}
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(cfg.cpu_threads),
    }


def engine_args(cfg: GeneratorConfig, model: str, loras: list[LoRAConfig] = ()) -> Any:
    """vLLM's AsyncEngineArgs for `model` under the `generator` section (and the policies' adapters)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    unknown = sorted(set(cfg.engine) - {f.name for f in dataclasses.fields(AsyncEngineArgs)})
    if unknown:
        raise ValueError(f"unknown vLLM engine option(s) {unknown} (generator config key 'engine')")
    return AsyncEngineArgs(
        model=model,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="services.vllm_worker.WeightReloader",
        # vLLM seeds the sampling of requests without a seed with 0 unless told: every replica, a
        # respawned one and every run would draw the same samples. A fresh seed per engine
        # (`generator.engine.seed` pins one).
        **{"seed": int.from_bytes(os.urandom(4), "little"), **_lora_args(cfg, list(loras)), **cfg.engine},
    )


def _record(found: tuple[tuple[int, ...], bytes] | None, length: int) -> torch.Tensor | None:
    """A sample's routing record from vLLM's worker as `length` positions (-1 past what it holds);
    None if it holds none (that sample's tokens are then routed by the trainer itself)."""
    if found is None:
        return None
    shape, data = found
    got = torch.frombuffer(bytearray(data), dtype=torch.int16).reshape(shape)[:length]
    record = torch.full((length, *shape[1:]), -1, dtype=torch.int16)
    record[: got.shape[0]] = got
    return record


def _prompt_logprobs(found: list[Any] | None) -> list[dict[int, float] | None]:
    """vLLM's prompt logprobs ({token id: Logprob} per position, None first) as plain floats."""
    return [None if p is None else {t: lp.logprob for t, lp in p.items()} for p in found or []]


async def _nothing() -> Any:
    """No outputs: the stream of a request aborted before it started."""
    return
    yield


def _preview(prompt: Any) -> str:
    text = repr(prompt)
    return text if len(text) <= 60 else text[:57] + "..."


def _advise_tcmalloc() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and "libtcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        logs.advise(
            "tcmalloc",
            "vLLM on CPU runs slower without tcmalloc: install it (Debian: apt-get install libtcmalloc-minimal4) "
            "and start forge with LD_PRELOAD naming it, e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "
            "(vLLM's CPU guide, 'set LD_PRELOAD')",
        )


@dataclass
class _Policy:
    """One policy a generator serves: where its versions come from, the version held and, for a
    LoRA policy, its adapters loaded in vLLM."""

    name: str  # the run it is ("": the generator's own)
    store: Any = None  # the forge.store.WeightStore `load_version` loads from
    lora: LoRAConfig | None = None  # a version is an adapter of this config; None: the model's own weights
    version: int = 0
    adapter: Any = None  # the LoRARequest of the version held (None: the base model's weights)
    adapters: dict[int, tuple[Any, Path]] = field(default_factory=dict)  # version -> its LoRARequest, its directory
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None  # the held adapter's tensors' (vLLM took them)
    users: collections.Counter[int] = field(default_factory=collections.Counter)  # requests in flight per version
    pull: asyncio.Lock = field(default_factory=asyncio.Lock)  # one fetch of the store's latest at a time


class Generator(ForgeActor):
    """vLLM generation service. Endpoints: generate, stream, abort, add_lora, load_weights,
    load_version, add_policy, remove_policy, policy_version, last_swaps, engine_pids.

    With `tenants`, several runs share it, each training its own LoRA adapter: a call's
    `policy=NAME` picks the run whose adapter and version it samples with and reports. LoRA
    policies also join and leave at run time (`add_policy`, `remove_policy`: Tinker's samplers)."""

    @classmethod
    def check_args(
        cls,
        model: str | Path,
        cfg: GeneratorConfig | None = None,
        weights_from: Any = None,
        lora: Any = None,
        tenants: dict[str, tuple[Any, LoRAConfig]] | None = None,
    ) -> None:
        require_file("model.path", Path(model) / "config.json")
        if cfg is not None and not isinstance(cfg, GeneratorConfig):
            raise TypeError(f"Generator: cfg must be a GeneratorConfig, got {type(cfg).__name__}")
        for given in [lora, *(t[1] for t in (tenants or {}).values())]:
            if given is not None and not isinstance(given, LoRAConfig):
                raise TypeError(f"Generator: lora must be a LoRAConfig, got {type(given).__name__}")
        if tenants and weights_from is not None:
            raise ValueError("Generator: a shared generator (tenants) serves the base model; weights_from is one run's")
        for name, (_, tenant_lora) in (tenants or {}).items():
            if not name or not tenant_lora.enabled:
                raise ConfigError(
                    f"run {name!r} shares a generator: it must be named and train a LoRA adapter "
                    "(config key 'trainer.lora.rank' > 0); the base weights are everyone's"
                )

    def __init__(
        self,
        model: str | Path,
        cfg: GeneratorConfig | None = None,
        weights_from: Any = None,
        lora: LoRAConfig | None = None,
        tenants: dict[str, tuple[Any, LoRAConfig]] | None = None,
    ):
        """`weights_from`: the forge.store.WeightStore that `load_version` loads from. `lora`
        (enabled): a version is a LoRA adapter of the trainer's `trainer.lora`, on this base model.
        `tenants`: the runs sharing this generator, by name: each one's weight store and LoRA config."""
        self.model, self.cfg = str(model), cfg or GeneratorConfig()
        own = _Policy("", weights_from, lora if lora is not None and lora.enabled else None)
        self.policies = {"": own} | {name: _Policy(name, *tenant) for name, tenant in (tenants or {}).items()}
        # vLLM's id of each policy adapter: unique, and apart from the ids vLLM's server gives named ones.
        self._adapter_ids = itertools.count(1 << 30)
        self.engine = None
        self._swap = asyncio.Lock()
        self._stage_errors: set[str] = set()
        self._pauses: collections.deque[float] = collections.deque(maxlen=32)
        self._lora_loads: dict[int, asyncio.Future] = {}  # adapter id -> its add_lora under way
        # `stream` requests aborted (the newest ABORTS_KEPT): one whose abort came before vLLM knew
        # it, which vLLM's abort then missed, ends at its start or first output, not after all its tokens.
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._in_flight, self._busy_mark = 0, 0.0

    @endpoint
    async def setup(self) -> None:
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(self.cfg.cache_dir).absolute()))
        os.environ["FORGE_GENERATOR_PID"] = str(os.getpid())  # vLLM's processes exit with this one
        os.environ.update(engine_env(self.cfg))
        try:
            loras = [p.lora for p in self.policies.values() if p.lora is not None]
            self.engine = AsyncLLM.from_engine_args(engine_args(self.cfg, self.model, loras))
        except Exception as e:  # e.g. pydantic's ValidationError, which cannot be pickled back to the caller
            raise ValueError(f"Generator: vLLM cannot start on {self.model}: {e}") from None
        self.vocab_size = self.engine.model_config.get_vocab_size()
        _advise_tcmalloc()
        # Chat prompts are rendered by the code vLLM's OpenAI server renders them with (the
        # tokenizer's chat template, the generation prompt, tools): training, evals and
        # `forge serve` see the same tokens for the same messages.
        self.chat = OnlineRenderer(
            self.engine.model_config,
            self.engine.renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            default_chat_template_kwargs=dict(self.cfg.chat_template_kwargs),
        )
        self.routing = await self._record_routing()
        await self._warm_up()
        for policy in self.policies.values():
            if policy.store is not None:
                await self._pull_latest(policy)  # a respawned replica starts on the latest policy

    async def _warm_up(self) -> None:
        # vLLM torch.compiles its sampling and logprob kernels on the first requests that use
        # them (2.5-4 s here, even from the compile cache): pay that at startup, not in the
        # first rollout or weight swap. Batches of 1 and of 2+ compile separately.
        from vllm.inputs import TokensPrompt

        sp = {**dataclasses.asdict(self.cfg.sampling), "temperature": 1.0, "max_tokens": 2, "stop": None}
        for n in (1, 2):
            async for _ in self.engine.generate(
                TokensPrompt(prompt_token_ids=[0]), self._sampling_params(n, sp), uuid.uuid4().hex
            ):
                pass

    async def _record_routing(self) -> bool:
        if self.cfg.routing_replay is False:
            return False
        hooked = (await self.engine.collective_rpc("forge_record_routing"))[0]
        if not hooked and self.cfg.routing_replay:
            raise ConfigError(f"config key 'generator.routing_replay' is true, but {self.model} has no routed experts")
        return bool(hooked)

    async def _routed_experts(self, request_id: str, prompt_len: int, samples: list[tuple[int, int]]) -> list[Any]:
        """The routing record of each (sample index, tokens) of a finished request: [prompt +
        completion tokens, layers, top_k] int16, -1 where none was computed; None without routing
        replay. The samples share their prompt: a prompt position that one of them computed (the
        others found it in the prefix cache) is filled in for all."""
        if not self.routing:
            return [None] * len(samples)
        found = (await self.engine.collective_rpc("forge_routed_experts", args=(request_id,)))[0]
        out = [_record(found.get(index), prompt_len + n) for index, n in samples]
        held = [r for r in out if r is not None]
        for r in held:
            for other in held:
                r[:prompt_len] = torch.where(r[:prompt_len] < 0, other[:prompt_len], r[:prompt_len])
        return out

    def _policy(self, name: str) -> _Policy:
        if name not in self.policies:
            runs = ", ".join(repr(n) for n in self.policies if n) or "none"
            raise ValueError(f"generator: no policy {name!r} here (runs sharing it: {runs})")
        return self.policies[name]

    async def _pull_latest(self, policy: _Policy) -> None:
        """Fetch the store's latest version (generation goes on meanwhile), then swap it in."""
        store = policy.store
        version = await store.latest()
        if version is None or version <= policy.version:
            return
        start = asyncio.get_running_loop().time()
        path = None if policy.lora else await store.local_path(version)
        try:
            if policy.lora:  # a version is an adapter of a few MB: fetched whole
                paused = await self._add_adapter(policy, await store.fetch(version), version)
            elif path is not None:  # shm (the writer's file or this host's copy): vLLM's worker maps it itself
                check = functools.partial(store.check_intact, version, path)
                paused = await self.swap_from_file(path, version, check=check)
            else:
                paused = await self.load_weights_local(await store.fetch(version), version)
        except KeyError:  # dropped (and its file reused) while we read it: take the newer one
            log.warning("forge: weights version %d was replaced while loading; loading the latest", version)
            return await self._pull_latest(policy)
        record_metric("generator/weight_sync_s", asyncio.get_running_loop().time() - start)
        if paused is not None:
            record_metric("generator/weight_swap_paused_s", paused, Reduce.MAX)

    # ---- generation ----------------------------------------------------------------

    def _sampling_params(self, n: int, merged: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                n=n,
                logprobs=0,  # the sampled token's own logprob
                # text == decode(token_ids), stop string included (`_text`: one that ends inside a token)
                include_stop_str_in_output=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
                **merged,
            )
        except (TypeError, VLLMClientError) as e:  # an unknown option; a value vLLM refuses (n=0)
            raise ValueError(f"generate: bad sampling option in {merged}: {e}") from None

    async def _engine_prompt(self, prompt: Any, tools: list[dict[str, Any]] | None = None) -> Any:
        from vllm.inputs import TokensPrompt

        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return await self._render_chat(list(prompt), tools)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("generate: prompt is empty")
            return prompt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise ValueError("generate: prompt is empty (no token ids)")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"generate: prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
            return TokensPrompt(prompt_token_ids=list(prompt))
        raise TypeError(
            f"generate: prompt must be a str, a list of token ids or a list of chat messages, got "
            f"{type(prompt).__name__} {_preview(prompt)}"
        )

    async def _render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any:
        """Chat `messages` (and `tools`, OpenAI's format) as the prompt vLLM's server makes of them."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        try:
            # tool_choice "none": the tools are rendered for the model; parsing its calls is the caller's
            request = ChatCompletionRequest(
                model=self.model, messages=messages, tools=tools, tool_choice="none" if tools else None
            )
        except ValueError as e:  # pydantic's ValidationError: not picklable back to the caller
            raise ValueError(f"generate: bad chat messages {_preview(messages)}: {e}") from None
        rendered = await self.chat.render_chat(request)
        if isinstance(rendered, ErrorResponse):
            raise ValueError(f"generate: cannot render chat messages {_preview(messages)}: {rendered.error.message}")
        return rendered[1][0]

    def _count_busy(self, change: int) -> None:
        """generator/busy_s: time with any request in flight (the utilization benchmarks report),
        recorded at every start and end so a long busy stretch lands in the flushes it spans."""
        now = time.perf_counter()
        if self._in_flight:
            record_metric("generator/busy_s", now - self._busy_mark, Reduce.SUM)
        self._in_flight += change
        self._busy_mark = now

    async def _outputs(
        self,
        engine_prompt: Any,
        params: Any,
        request_id: str,
        timeout_s: float | None,
        prompt: Any,
        policy: _Policy,
        adapter: Any = None,
    ):
        """vLLM's outputs for one request, with forge's errors: a bad prompt is a ValueError for this
        request only, a slow one a TimeoutError (and aborted), a dead engine ends this replica.
        `adapter`: a named LoRA adapter's LoRARequest (vLLM's server makes it), else `policy`'s."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        timeout_s = timeout_s or self.cfg.request_timeout_s
        self._count_busy(+1)
        version, adapter = policy.version, adapter or policy.adapter  # a LoRA request keeps its adapter to the end
        policy.users[version] += 1
        try:
            async with asyncio.timeout(timeout_s):
                async for out in self.engine.generate(engine_prompt, params, request_id, lora_request=adapter):
                    yield out
        except TimeoutError:
            await self.engine.abort(request_id)
            raise TimeoutError(
                f"generate: no answer within {timeout_s}s (generator config key 'request_timeout_s') for prompt "
                f"{_preview(prompt)}"
            ) from None
        except EngineDeadError:
            # A dead engine never recovers in place: end this process, so the service sees the
            # replica die, retries this call elsewhere and respawns the replica.
            log.error("forge: the vLLM engine died; exiting so the service respawns this replica")
            os.kill(os.getpid(), signal.SIGKILL)
            raise
        except (ValueError, VLLMClientError) as e:  # vLLM's input checks, e.g. longer than max_model_len
            raise ValueError(f"generate: prompt {_preview(prompt)}: {e}") from None
        finally:
            self._count_busy(-1)
            policy.users[version] -= 1
            await self._drop_unused_adapters(policy)

    async def _sample(
        self, prompt: Any, tools: list[dict[str, Any]] | None, params: Any, timeout_s: float | None, policy: _Policy
    ) -> tuple[int, str, Any]:
        """`prompt` rendered, then sampled with `policy`'s version held once it is: that version,
        the request's id and vLLM's final output."""
        engine_prompt = await self._engine_prompt(prompt, tools)
        # No await from reading the version to where `_outputs` takes the adapter it samples with:
        # a new version may land while a chat renders (in a thread, other calls going on).
        admitted, request_id, final = policy.version, uuid.uuid4().hex, None
        async for out in self._outputs(engine_prompt, params, request_id, timeout_s, prompt, policy):
            final = out
        return admitted, request_id, final

    @concurrent_endpoint
    async def generate(
        self,
        prompt: str | list[int],
        n: int = 1,
        sampling: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        policy: str = "",
        tools: list[dict[str, Any]] | None = None,
    ) -> list[Completion]:
        """`n` samples for one prompt: a string, token ids, or chat messages ({role, content}
        dicts, rendered as `forge serve` renders them, with `tools` in OpenAI's format), with
        `policy`'s weights (a run sharing this generator; "": its own). Raises ValueError/TypeError
        for a bad prompt (this request only), TimeoutError after `timeout_s` (default: config
        `request_timeout_s`)."""
        p = self._policy(policy)
        sp = {**dataclasses.asdict(self.cfg.sampling), **(sampling or {})}
        params = self._sampling_params(n, sp)
        admitted, request_id, final = await self._sample(prompt, tools, params, timeout_s, p)
        finished = admitted if p.lora else p.version  # LoRA: every token under the admitted adapter
        prompt_ids = list(final.prompt_token_ids)
        prompt_logprobs = _prompt_logprobs(final.prompt_logprobs) if sp.get("prompt_logprobs") is not None else None
        routing = await self._routed_experts(
            request_id, len(prompt_ids), [(c.index, len(c.token_ids)) for c in final.outputs]
        )
        thinking = self._opens_thinking(prompt_ids, params)
        return [
            Completion(
                prompt_ids=prompt_ids,
                token_ids=list(c.token_ids),
                logprobs=[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                text=self._text(c, params),
                finish_reason=c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "stop",
                sampling={**sp, "n": n},
                policy_version=admitted,
                max_policy_version=finished,
                prompt=prompt if isinstance(prompt, str) else None,
                routed_experts=routed,
                thinking=thinking,
                prompt_logprobs=prompt_logprobs,
            )
            for c, routed in zip(final.outputs, routing)
        ]

    def _opens_thinking(self, prompt_ids: list[int], params: Any) -> bool:
        """Whether the prompt ends with <think> (a chat template that opens the reasoning for the
        model, as DeepSeek-R1's and QwQ's do), decoded as the samples' text is: where the tags
        are special tokens the text drops, its </think> is not there to be read either."""
        tail = self.engine.get_tokenizer().decode(prompt_ids[-8:], skip_special_tokens=params.skip_special_tokens)
        return tail.rstrip().endswith("<think>")

    def _text(self, c: Any, params: Any) -> str:
        """A sample's text: vLLM's, and where a stop string ended inside a token, the rest of that
        token (vLLM cuts the text at the stop string but keeps the whole token, which the trainer
        trains and the reward must then see)."""
        stop = c.stop_reason
        if not isinstance(stop, str) or not stop:
            return c.text
        # The tokens' own decode only for what follows the stop string: vLLM's text keeps what
        # decoding alone would change (a first token's leading space, clean-up of spaces).
        tokens = self.engine.get_tokenizer().decode(
            c.token_ids, skip_special_tokens=params.skip_special_tokens, clean_up_tokenization_spaces=False
        )
        at = tokens.rfind(stop)
        return c.text + tokens[at + len(stop) :] if at >= 0 and c.text.endswith(stop) else c.text

    @concurrent_endpoint
    async def stream(
        self, port: Any, prompt: dict[str, Any], params: Any, request_id: str, adapter: Any = None
    ) -> tuple[int, int, list[Any], Any]:
        """Server mode (services/gateway.py): one request as vLLM's own server makes it (a rendered
        EngineInput and SamplingParams). Each RequestOutput vLLM yields is sent to `port`, then
        None; returns the policy versions the request was admitted and finished under, each
        sample's routing record (by index; see `generate`), and None. The first message is
        "start": a retry on another replica (this one died) starts again with it. With no
        `port` (a request not streamed), nothing is sent and the last RequestOutput is returned
        in place of the None: no port, and three messages fewer a request."""
        from vllm.sampling_params import RequestOutputKind

        policy = self.policies[""]
        admitted, sampled, last = policy.version, collections.Counter(), None
        send = port.send if port is not None else (lambda _: None)
        send("start")
        try:
            shown = prompt.get("prompt_token_ids")
            outputs = self._outputs(prompt, params, request_id, None, shown, policy, adapter)
            async for out in outputs if request_id not in self._aborted else _nothing():
                if request_id in self._aborted:  # aborted while vLLM took it in
                    await self.engine.abort(request_id)
                    break
                for c in out.outputs:  # tokens so far: DELTA outputs carry only the new ones
                    n = len(c.token_ids)
                    sampled[c.index] = sampled[c.index] + n if params.output_kind == RequestOutputKind.DELTA else n
                send(out)
                last = out
        finally:
            send(None)
            self._aborted.pop(request_id, None)
        prompt_len = len(prompt.get("prompt_token_ids") or [])
        finished = admitted if policy.lora else policy.version
        routing = await self._routed_experts(request_id, prompt_len, sorted(sampled.items()))
        return admitted, finished, routing, last if port is None else None

    @endpoint
    async def abort(self, request_id: str) -> None:
        """Stop a `stream` request (its client went away): vLLM frees its sequence; one not started
        yet ends as it starts."""
        self._aborted[request_id] = None
        while len(self._aborted) > ABORTS_KEPT:
            self._aborted.popitem(last=False)
        await self.engine.abort(request_id)

    @endpoint
    async def add_lora(self, request: Any) -> bool:
        """Load a named adapter (vLLM's server asks, for `--lora NAME=DIR`); requests naming it use it."""
        return await self.engine.add_lora(request)

    @endpoint
    async def unfinished_requests(self) -> int:
        """Requests vLLM still holds (running or waiting)."""
        return self.engine.output_processor.get_num_unfinished_requests()

    # ---- weights -------------------------------------------------------------------

    @concurrent_endpoint
    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int, policy: str = "") -> float | None:
        """Swap in `state_dict` (HF names; a LoRA policy's: its adapter, PEFT names) as `policy`'s
        `version`, without restarting the engine. Requests in flight are paused and kept, not
        dropped. Returns the seconds generation was paused (None: an adapter vLLM is loading).
        Weights that do not fit the model (a name or a shape) raise ValueError; with `staged_swap`
        the replica keeps the weights and version it had."""
        p = self._policy(policy)
        if p.lora:
            return await self._add_adapter(p, state_dict, version)
        return await self.load_weights_local(state_dict, version)

    async def load_weights_local(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=run_dir())
        os.close(fd)
        try:
            await asyncio.to_thread(write_safetensors, state_dict, path)
            return await self.swap_from_file(path, version, keep_mapping=False)
        finally:
            os.unlink(path)

    async def swap_from_file(
        self,
        path: str,
        version: int,
        keep_mapping: bool = True,
        check: Callable[[], Awaitable[None]] | None = None,
    ) -> float:
        """Swap in the weights of `path` as `version`; the seconds generation paused.
        `check` raises if what was read of the file is not the version (the writer reused it):
        it runs before staged weights go live, or after an in-place reload."""
        loop = asyncio.get_running_loop()
        async with self._swap:
            staged = self.cfg.staged_swap and await self._stage(path, keep_mapping)
            if staged and check is not None:
                await check()
            start = loop.time()
            # AsyncLLM.pause_generation is this call plus a 20 ms sleep that only orders log
            # output (its comment says so) and a multimodal-cache reset text models do not need.
            await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=True)
            try:
                if staged:
                    await self.engine.collective_rpc("forge_commit")
                else:
                    await self.engine.collective_rpc("forge_reload", args=(path, keep_mapping))
                # Prefix-cache entries hold KV computed with the old weights.
                await self.engine.reset_prefix_cache()
                self.policies[""].version = version
            finally:
                await self.engine.resume_generation()
            self._pauses.append(loop.time() - start)
            if not staged and check is not None:
                await check()
            return self._pauses[-1]

    async def _add_adapter(self, policy: _Policy, tensors: dict[str, torch.Tensor], version: int) -> float | None:
        """`policy`'s version `version` is the LoRA adapter `tensors` (PEFT names), loaded beside the
        ones in use; requests admitted from then on use it, and the base weights never move. The
        first adapter (or one of other shapes) is live once vLLM has loaded it; a later one of the
        same shapes, which vLLM cannot refuse, as soon as its directory is written: vLLM loads it
        between two steps (add_lora, sent meanwhile, or the scheduler for the first request naming
        it) instead of the version waiting for the engine's step under way. Returns the seconds the
        engine spent loading it (None: still loading)."""
        from vllm.lora.request import LoRARequest

        name = policy.name or "policy"
        shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
        async with self._swap:
            where = Path(run_dir()) / f"adapter-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}-v{version}"
            await asyncio.to_thread(write_adapter, where, tensors, policy.lora, self.model)
            request = LoRARequest(f"{name}-v{version}", next(self._adapter_ids), str(where))
            paused = None
            if shapes != policy.shapes:  # vLLM checks it: a bad adapter raises here, not in a request
                paused = await self._engine_add_lora(request, where)
            else:
                loading = asyncio.ensure_future(self._engine_add_lora(request, where))
                self._lora_loads[request.lora_int_id] = loading
                loading.add_done_callback(functools.partial(self._lora_loaded, request.lora_int_id))
            policy.adapters[version] = (request, where)
            policy.adapter, policy.version, policy.shapes = request, version, shapes
        await self._drop_unused_adapters(policy)
        return paused

    def _lora_loaded(self, adapter_id: int, task: asyncio.Future) -> None:
        self._lora_loads.pop(adapter_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.warning("forge: vLLM could not load a LoRA adapter: %s", task.exception())

    async def _engine_add_lora(self, request: Any, where: Path) -> float:
        start = time.perf_counter()
        try:
            await self.engine.add_lora(request)
        except Exception:
            shutil.rmtree(where, ignore_errors=True)
            raise
        paused = time.perf_counter() - start
        self._pauses.append(paused)
        return paused

    async def _drop_unused_adapters(self, policy: _Policy) -> None:
        """Unload `policy`'s adapters of versions older than the one held that no request uses any more."""
        if self.engine is None:
            return
        for version in [v for v in policy.adapters if v < policy.version and not policy.users[v]]:
            held = policy.adapters.get(version)
            if held is None or held[0].lora_int_id in self._lora_loads:  # taken by another call; being read by vLLM
                continue
            del policy.adapters[version]
            request, where = held
            policy.users.pop(version, None)
            await self.engine.remove_lora(request.lora_int_id)
            shutil.rmtree(where, ignore_errors=True)

    async def _stage(self, path: str, keep_mapping: bool) -> bool:
        """Prepare the weights of `path` in vLLM's worker while generation goes on. False when
        they cannot be staged: the swap then reloads in place."""
        start = time.perf_counter()
        await self.engine.collective_rpc("forge_stage", args=(path, keep_mapping))
        while None in (status := await self.engine.collective_rpc("forge_staged")):
            await asyncio.sleep(0.002)  # a poll is one small call between engine steps
        errors = [s for s in status if s]
        if any(not e.startswith("StageError:") for e in errors):
            # vLLM's own loader refused them (a name, a shape): an in-place reload would fail the
            # same way half-way, leaving the live model unusable.
            raise ValueError(f"Generator: the weights do not fit {self.model}: {errors[0]}")
        if errors:
            if errors[0] not in self._stage_errors:  # once each: a model that cannot be staged says so every swap
                self._stage_errors.add(errors[0])
                log.warning("forge: cannot stage new weights (%s); reloading them while generation waits", errors[0])
            return False
        record_metric("generator/weight_stage_s", time.perf_counter() - start, Reduce.MAX)
        return True

    @concurrent_endpoint
    async def load_version(self, version: int, policy: str = "") -> int:
        """Load `policy`'s latest version from its store, `version` or newer, while generation goes
        on (a WeightSync calls it once the trainer published `version`). Returns the version held."""
        p = self._policy(policy)
        if p.store is None:
            raise ValueError(f"Generator.load_version: policy {policy!r} has no weight store (weights_from)")
        async with p.pull:
            if p.version < version:
                await self._pull_latest(p)
        if p.version < version:
            raise KeyError(f"Generator.load_version: version {version} is not in the weight store {p.store.name!r}")
        return p.version

    @endpoint
    async def add_policy(self, name: str, lora: LoRAConfig) -> None:
        """A LoRA policy joins at run time (a Tinker sampler): its versions come by `load_weights`.
        The engine must have started with LoRA (a LoRA policy: `lora` or `tenants`)."""
        self._add_policy(name, lora)

    def _add_policy(self, name: str, lora: LoRAConfig) -> _Policy:
        if not name or name in self.policies:
            raise ValueError(f"generator: policy {name!r} exists (or has no name)")
        if not self.engine.vllm_config.lora_config:
            raise ValueError("generator: vLLM started without LoRA; start it with a LoRA policy")
        self.policies[name] = _Policy(name, None, lora)
        return self.policies[name]

    @endpoint
    async def on_respawn(self, restore_point: Any = None) -> None:
        """A new replica after a crash; it loaded the latest weights in `setup`. The policies that
        joined at run time are the service's restore point, {name: (LoRAConfig, adapter tensors)}
        (its owner keeps it current): each joins again with its adapter."""
        for name, (lora, tensors) in dict(restore_point or {}).items():
            await self._add_adapter(self._add_policy(name, lora), tensors, 1)

    @endpoint
    async def remove_policy(self, name: str) -> None:
        """`name` leaves: its adapters are unloaded as soon as no request uses them."""
        policy = self.policies.pop(name, None)
        if policy is not None:
            policy.version += 1  # every adapter it holds is now an old one
            await self._drop_unused_adapters(policy)

    @endpoint
    async def reserve_weights(self, layout: dict | None) -> bool:
        """Make room now for the versions a trainer on another host will publish (`layout`: its
        `weights_layout`), so the first of them streams into allocated memory (`WeightStore.reserve`).
        Returns whether this replica allocated it (one per host)."""
        policy = self.policies[""]
        if policy.store is None or policy.lora is not None:  # a LoRA version is fetched whole, not copied per host
            return False
        return await asyncio.to_thread(policy.store.reserve, layout)

    @endpoint
    async def policy_version(self, policy: str = "") -> int:
        return self._policy(policy).version

    @endpoint
    async def last_swaps(self) -> list[float]:
        """Seconds generation was paused by each recent weight swap (newest last)."""
        return list(self._pauses)

    @endpoint
    async def engine_pids(self) -> list[int]:
        """vLLM's processes under this replica: EngineCore first, then its workers."""
        import psutil

        return [c.pid for c in psutil.Process().children(recursive=True) if c.name().startswith("VLLM::")]

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown(timeout=1.0)  # within Monarch's cleanup deadline
            for policy in self.policies.values():
                for _, where in policy.adapters.values():
                    shutil.rmtree(where, ignore_errors=True)
            del engine
            gc.collect()  # AsyncLLM.__del__ now, not at interpreter exit when its imports are gone


class RunGenerator:
    """One run's handle on a generator service that several runs share (`tenants`): the calls of
    the endpoints that take a `policy` name the run, so its rollout functions, evals and
    WeightSync sample with, load and report its own adapter without knowing they share."""

    TAGGED = ("generate", "load_weights", "load_version", "policy_version")

    def __init__(self, gen: Any, run: str):
        self.gen, self.run = gen, run

    def __getattr__(self, name: str) -> Any:
        endpoint = getattr(self.gen, name)
        return _RunEndpoint(endpoint, self.run) if name in self.TAGGED else endpoint


class _RunEndpoint:
    def __init__(self, endpoint: Any, run: str):
        self.endpoint, self.run = endpoint, run

    async def route(self, *args: Any, **kwargs: Any) -> Any:
        return await self.endpoint.route(*args, policy=self.run, **kwargs)

    async def call(self, *args: Any, **kwargs: Any) -> list[Any]:
        return await self.endpoint.call(*args, policy=self.run, **kwargs)

    async def fanout(self, *args: Any, **kwargs: Any) -> list[Any]:
        return await self.endpoint.fanout(*args, policy=self.run, **kwargs)
