"""Environments, agents and rewards for tests/test_agentic.py and tests/test_rewards.py (imported by
name in the environment and reward actors)."""

import asyncio
import itertools
import os
import time


class TwoStepEnv:
    """Asks the task's prompt, answers the first reply with a tool result, ends on the second."""

    def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": task["prompt"]}], None

    def step(self, message):
        from forge.env import EnvStep

        self.turn += 1
        if self.turn == 1:
            return EnvStep([{"role": "tool", "content": "42", "tool_call_id": "t1"}])
        return EnvStep(done=True, reward=float(len(message.get("content") or "") % 2), info={"correct": 1.0})

    def close(self):
        pass


class RaisingEnv(TwoStepEnv):
    def step(self, message):
        raise RuntimeError("the environment broke")


class HangingEnv(TwoStepEnv):
    async def step(self, message):
        await asyncio.Event().wait()


async def two_call_agent(client, task):
    """An unmodified agent: the plain openai client, two calls, its own edit of the history."""
    messages = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "sure?"}]
    r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    return {"reward": float(len(r.choices[0].message.content or "") % 2), "correct": 0.0}


async def raising_agent(client, task):
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raise ValueError("the agent's tool crashed")


async def wrong_return_agent(client, task):
    return "done"


class FlakyEnv(TwoStepEnv):
    """Every other environment made in this process raises on its first step."""

    made = 0

    def __init__(self):
        FlakyEnv.made += 1
        self.broken = FlakyEnv.made % 2 == 0

    def step(self, message):
        if self.broken:
            raise ConnectionError("sandbox unreachable")
        return super().step(message)


_episodes = itertools.count()


def second_of_four() -> bool:
    """True for the second call of each four: one episode of a group of 4 run in order."""
    return next(_episodes) % 4 == 1


class NanEnv(TwoStepEnv):
    """Ends at its first step; one episode of each four gets a NaN reward (a metric's 0/0)."""

    def step(self, message):
        from forge.env import EnvStep

        return EnvStep(done=True, reward=float("nan") if second_of_four() else 1.0, info={"correct": 1.0})


async def inf_agent(client, task):
    return {"reward": float("inf"), "correct": 0.0} if second_of_four() else {"reward": 1.0, "correct": 1.0}


async def sure_agent(client, task):
    return 1.0


async def lone_agent(client, task):
    """One episode of each four succeeds; the others' tool crashes."""
    if second_of_four():
        return 1.0
    raise ValueError("the agent's tool crashed")


async def stubborn_agent(client, task):
    """One episode of four swallows its cancellation (a retry loop's bare `except BaseException`)."""
    if second_of_four():
        await ignoring_cancellation(1.5)
    return 1.0


async def ignoring_cancellation(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass


async def one_call_agent(client, task):
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return 1.0


async def idling_agent(client, task):
    """One episode of four idles 1 s after its call (a long tool call)."""
    idles = second_of_four()
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    if idles:
        await asyncio.sleep(1.0)
    return 1.0


async def blocking_agent(client, task):
    """One episode of four blocks its event loop for 4 s (`time.sleep`, a blocking library)."""
    if second_of_four():
        time.sleep(4.0)
    return 1.0


async def spinning_agent(client, task):
    """One episode of four never gives its event loop back (a loop without an await)."""
    if second_of_four():
        while True:
            pass
    return 1.0


async def dying_agent(client, task):
    """One episode of four ends its process (a native library's abort, os._exit) after its call."""
    dies = second_of_four()
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    if dies:
        await asyncio.sleep(1.0)  # the others have ended by then
        os._exit(3)
    return 1.0


async def over_limit_agent(client, task):
    """Lets the gateway's 400 through (max_tokens past its limit): openai.BadRequestError, whose
    class cannot be rebuilt from its pickle."""
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)


async def exiting_agent(client, task):
    """One episode of four raises SystemExit (a tool's library calling sys.exit)."""
    if second_of_four():
        raise SystemExit(3)
    return 1.0


class Interrupted(BaseException):
    """A library's own BaseException (gevent's Timeout, trio.Cancelled, pytest's Exit...)."""


async def misbehaving_reward(s):
    """Async: ignores its cancellation past any timeout on 'stubborn', exits on 'exit', raises
    a BaseException on 'base'."""
    if s.completion == "stubborn":
        await ignoring_cancellation(1.5)
    if s.completion == "exit":
        raise SystemExit(3)
    if s.completion == "base":
        raise Interrupted("a BaseException from the reward")
    return 1.0


def blocking_reward(s):
    """Sync (run in a thread): hangs on 'sleep', exits on 'exit'."""
    if s.completion == "sleep":
        time.sleep(1.5)
    if s.completion == "exit":
        raise SystemExit(3)
    return 1.0


class NotedEnv(TwoStepEnv):
    """Ends at its first step with a note in its info: text, where the numbers go."""

    def step(self, message):
        from forge.env import EnvStep

        return EnvStep(done=True, reward=1.0, info={"correct": 1.0, "note": "solved it"})
