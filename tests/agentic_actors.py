"""Environments and agents for tests/test_agentic.py (imported by name in the environment actors)."""

import asyncio


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
