"""Calculator tools. For the `calc` toy task (forge/tasks.py), two ways:

- `Calculator`, a MessageEnv the framework drives (`agentic.env: services.envs.calculator:Calculator`).
- `calculator_agent`, an agent written with the plain `openai` client, as it would be without
  forge (`agentic.agent: services.envs.calculator:calculator_agent`).

Both: the model gets `345+678=`; a reply `calc 345+678` gets the tool's answer (`1023`) in a
tool message; the next reply is the answer. Reward 1 for the right sum, else 0 (a malformed
call, or no call, ends the episode at 0).

For chat models with function calling: `MathWithCalculator`, math word problems with a
`calculator` tool (the GPU config configs/grpo_qwen3_1.7b_gsm8k_tools.yaml).
"""

from __future__ import annotations

import ast
import json
import math
import operator
from typing import Any

from forge.env import EnvStep
from forge.tasks import get_task
from services.rewards.builtin import same_number

TASK = get_task("calc")


class Calculator:
    def reset(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], None]:
        self.answer, self.called = task["answer"], False
        return [{"role": "user", "content": task["prompt"]}], None

    def step(self, message: dict[str, Any]) -> EnvStep:
        text = message.get("content") or ""
        if self.called:
            right = TASK.score(text, self.answer)
            return EnvStep(done=True, reward=right, info={"correct": right})
        result = TASK.tool(text)
        if result is None:
            return EnvStep(done=True, reward=0.0, info={"correct": 0.0, "malformed_call": 1.0})
        self.called = True
        return EnvStep([{"role": "tool", "content": result, "tool_call_id": "calc"}])

    def close(self) -> None:
        pass


async def calculator_agent(client: Any, task: dict[str, Any]) -> dict[str, float]:
    """An agent as one writes it against any OpenAI-compatible server."""
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": task["prompt"]}]
    reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=1.0)
    call = reply.choices[0].message.content or ""
    result = TASK.tool(call)  # the agent's own tool
    if result is None:
        return {"reward": 0.0, "correct": 0.0}
    messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": result, "tool_call_id": "calc"}]
    reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0)
    right = TASK.score(reply.choices[0].message.content or "", task["answer"])
    return {"reward": right, "correct": right}


CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (48 + 24) * 3 / 2"}},
            "required": ["expression"],
        },
    },
}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


MAX_EXPRESSION_CHARS = 1000
MAX_BITS = 1024  # every intermediate integer; floats overflow on their own at ~1e308


def _bounded(x: float) -> float:
    if (isinstance(x, int) and x.bit_length() > MAX_BITS) or (isinstance(x, float) and not math.isfinite(x)):
        raise ValueError(f"a result over {MAX_BITS} bits")
    return x


def _power(left: float, right: float) -> float:
    # Refused before it is computed: ((9**64)**64)**64 would take the replica's memory and CPU to
    # find out. Past this check the result has at most 2 x MAX_BITS bits.
    if isinstance(left, int) and isinstance(right, int) and (abs(left).bit_length() - 1) * right > MAX_BITS:
        raise ValueError(f"a result over {MAX_BITS} bits")
    return _bounded(operator.pow(left, right))


def evaluate(expression: str) -> float:
    """An arithmetic expression's value; anything else (names, calls, results over MAX_BITS bits,
    expressions over MAX_EXPRESSION_CHARS) is a ValueError. Walked by hand because `eval` would
    run whatever the model writes."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            return _power(value(node.left), value(node.right))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _bounded(_OPS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError(f"not arithmetic: {ast.unparse(node)[:40]!r}")

    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"an expression over {MAX_EXPRESSION_CHARS} characters")
    try:
        return value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError, OverflowError, RecursionError) as e:
        raise ValueError(str(e) or type(e).__name__) from None


class MathWithCalculator:
    """A math word problem (a dataset row: `prompt` and a reference `answer` ending in its final
    number, e.g. GSM8K's '#### 72') with a `calculator` function tool, for chat models with tool
    calling (configs/grpo_qwen3_1.7b_gsm8k_tools.yaml). Each tool call gets its result (or the
    error) in a tool message; the first reply without a tool call is the answer, rewarded 1 when
    its final number is the reference's."""

    def reset(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        self.answer, self.calls = task["answer"], 0
        return [{"role": "user", "content": task["prompt"]}], [CALCULATOR_TOOL]

    def step(self, message: dict[str, Any]) -> EnvStep:
        calls = message.get("tool_calls") or []
        if not calls:
            right = same_number(self.answer, message.get("content") or "")
            return EnvStep(done=True, reward=right, info={"correct": right, "tool_calls": float(self.calls)})
        replies = []
        for c in calls:
            self.calls += 1
            try:
                result = str(evaluate(json.loads(c["function"]["arguments"])["expression"]))
            except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
                result = f"error: {e}"
            replies.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        return EnvStep(replies)

    def close(self) -> None:
        pass
