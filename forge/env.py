"""Environments the framework drives: the MessageEnv protocol, the episode loop that runs one
through the gateway, and an adapter for OpenEnv environments.

    class Calculator:                                    # a MessageEnv; methods sync or async
        def reset(self, task: dict) -> tuple[list[dict], list[dict] | None]: ...   # opening messages, tools
        def step(self, message: dict) -> EnvStep: ...   # the assistant's message -> replies, done, reward
        def close(self) -> None: ...

`run_env_episode` asks the policy through the gateway, as any agent would (the OpenAI API,
the session's key), hands each assistant message to the environment and appends what it
answers, until the environment is done or `max_turns` pass. The gateway records the tokens.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class EnvStep:
    """What an environment answers to one assistant message."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # its replies: tool results, user turns
    done: bool = False
    reward: float = 0.0  # the episode's reward, read when done
    info: dict[str, float] = field(default_factory=dict)  # named reward components, counters


class MessageEnv(Protocol):
    def reset(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]: ...

    def step(self, message: dict[str, Any]) -> EnvStep: ...

    def close(self) -> None: ...


async def call(fn: Callable[..., Any], *args: Any, threads: Executor | None = None) -> Any:
    """Call a sync or async function (an environment's method, a reward; an object whose
    `__call__` is async too); a sync one runs in a thread of `threads` (else the loop's default),
    with this context (its metrics go where ours do, as with asyncio.to_thread), so a slow one
    never blocks the others."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(*args)
    run = contextvars.copy_context().run
    out = await asyncio.get_running_loop().run_in_executor(threads, run, fn, *args)
    return await out if inspect.isawaitable(out) else out


@dataclass
class EpisodeStats:
    turns: int = 0  # policy calls
    tool_calls: int = 0  # calls in the assistant messages
    env_s: list[float] = field(default_factory=list)  # seconds of each environment step
    tokens: int = 0  # the conversation's length in tokens after the last call (prompt + completion)
    truncated: bool = False  # ended by max_turns, max_tokens or the context length, not by the environment


# OpenAI response fields an assistant message sent back in the history needs (the rest are
# the response's own: refusal, audio, annotations...).
_MESSAGE_FIELDS = {"role", "content", "tool_calls"}


async def run_env_episode(
    env: Any,
    client: Any,
    task: dict[str, Any],
    model: str,
    max_turns: int,
    step_timeout_s: float,
    sampling: dict[str, Any],
    max_tokens: int | None = None,
) -> tuple[EnvStep, EpisodeStats]:
    """One episode of `env` with the policy behind `client` (an openai.AsyncOpenAI): returns
    the environment's last step (its reward) and the episode's counts. The episode ends when the
    environment says done, after `max_turns` policy calls, or once the conversation holds
    `max_tokens` tokens (each reply still goes to the environment first). The environment is
    closed however the episode ends."""
    import openai

    stats = EpisodeStats()
    last = EnvStep()
    try:
        messages, tools = await asyncio.wait_for(call(env.reset, task), step_timeout_s)
        messages = list(messages)
        for _ in range(max_turns):
            try:
                r = await client.chat.completions.create(
                    model=model, messages=messages, tools=tools or openai.omit, **sampling
                )
            except openai.BadRequestError as e:
                if "maximum context length" not in str(e):
                    raise
                stats.truncated = True  # the conversation outgrew the context: the episode ends here
                break
            stats.turns += 1
            if r.usage is not None:
                stats.tokens = r.usage.prompt_tokens + r.usage.completion_tokens
            message = r.choices[0].message.model_dump(exclude_none=True, include=_MESSAGE_FIELDS)
            stats.tool_calls += len(message.get("tool_calls") or [])
            messages.append(message)
            start = time.monotonic()
            last = await asyncio.wait_for(call(env.step, message), step_timeout_s)
            stats.env_s.append(time.monotonic() - start)
            messages += last.messages
            if last.done:
                break
            if max_tokens is not None and stats.tokens >= max_tokens:
                stats.truncated = True
                break
        else:
            stats.truncated = True
    finally:
        await asyncio.wait_for(call(env.close), step_timeout_s)
    return last, stats


class OpenEnvAdapter:
    """A MessageEnv over an OpenEnv environment, through openenv-core's client (an `EnvClient`
    subclass connected to the environment's server). OpenEnv speaks typed actions and
    observations, not chat: `to_action` makes the action from the assistant's message, and
    `to_messages` the replies from an observation. `reset_kwargs` picks what of the task row
    the environment's reset takes."""

    def __init__(
        self,
        client: Any,
        to_action: Callable[[dict[str, Any]], Any],
        to_messages: Callable[[Any], list[dict[str, Any]]],
        tools: list[dict[str, Any]] | None = None,
        reset_kwargs: Callable[[dict[str, Any]], dict[str, Any]] = lambda task: {},
    ):
        self.client, self.to_action, self.to_messages = client, to_action, to_messages
        self.tools, self.reset_kwargs = tools, reset_kwargs

    async def reset(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        await self.client.connect()
        result = await self.client.reset(**self.reset_kwargs(task))
        return self.to_messages(result.observation), self.tools

    async def step(self, message: dict[str, Any]) -> EnvStep:
        result = await self.client.step(self.to_action(message))
        return EnvStep(self.to_messages(result.observation), bool(result.done), float(result.reward or 0.0))

    async def close(self) -> None:
        await self.client.close()
