"""The `guess` toy task (forge/tasks.py): find a hidden word from the environment's answers, in
as few turns as the canonical play needs. Two ways, as for the calculator:

- `GuessWord`, a MessageEnv the framework drives (`agentic.env: services.envs.guess:GuessWord`).
- `guess_agent`, the same game played by an agent written with the plain `openai` client
  (`agentic.agent: services.envs.guess:guess_agent`).

The model gets `guess ???=` and answers with a word (`aaa`); each wrong guess gets the letters in
their right place as a user message (`.a.`). The episode ends at the right word (reward: the
canonical play's turns / the turns taken) or after `max_turns` guesses (0).
"""

from __future__ import annotations

from typing import Any

from forge.env import EnvStep
from forge.tasks import get_task

TASK = get_task("guess")


def _outcome(secret: str, turns: int, solved: bool) -> dict[str, float]:
    return {"reward": TASK.reward(secret, turns, solved), "correct": float(solved), "turns": float(turns)}


class GuessWord:
    def reset(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], None]:
        self.secret, self.turns = task["answer"], 0
        return [{"role": "user", "content": task["prompt"]}], None

    def step(self, message: dict[str, Any]) -> EnvStep:
        guess = (message.get("content") or "").strip()
        self.turns += 1
        solved = guess == self.secret
        if solved or self.turns >= TASK.max_turns:
            outcome = _outcome(self.secret, self.turns, solved)
            return EnvStep(done=True, reward=outcome.pop("reward"), info=outcome)
        return EnvStep([{"role": "user", "content": TASK.feedback(guess, self.secret)}])

    def close(self) -> None:
        pass


async def guess_agent(client: Any, task: dict[str, Any]) -> dict[str, float]:
    """The game as one writes it against any OpenAI-compatible server."""
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": task["prompt"]}]
    for turn in range(1, TASK.max_turns + 1):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0)
        guess = reply.choices[0].message.content or ""
        if guess.strip() == task["answer"]:
            return _outcome(task["answer"], turn, True)
        messages += [
            {"role": "assistant", "content": guess},  # as sampled: the next prompt extends this one token for token
            {"role": "user", "content": TASK.feedback(guess, task["answer"])},
        ]
    return _outcome(task["answer"], TASK.max_turns, False)
