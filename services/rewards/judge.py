"""The `judge` reward: a model served through the OpenAI API grades each completion.

    rewards:
      weights: {judge: 1.0}
      judge: {base_url: http://127.0.0.1:8000/v1, model: qwen3-8b, max_score: 10}

The rubric is a template the sample fills in; `pattern` finds the score in the judge's answer
(its last match outside any <think>...</think>: a judge that quotes the response or reasons
first may repeat a score the response wrote), divided by `max_score`. The judge is
infrastructure: an unreachable endpoint, a timeout, an HTTP error after `retries`, or an answer
with no score makes the reward unavailable (`RewardUnavailable("judge")`), never a wrong answer;
but a 400 or 422, which the sample's own request caused (too long for the judge), fails the sample.
"""

from __future__ import annotations

import re
from typing import Any

from forge.types import RewardInput, RewardUnavailable
from services.rewards.builtin import after_thinking
from services.schema import JudgeConfig

FENCE = re.compile(r"<(/?response)", re.IGNORECASE)


def as_text(completion: str) -> str:
    """A completion as text the judge reads inside its fence: it cannot close the default rubric's
    <response> fence (and write rubric text of its own after it), nor write a chat template's
    special tokens (<|im_start|>...: a forged earlier turn), which an OpenAI server reads as
    tokens in a message's text."""
    return FENCE.sub(r"&lt;\1", completion).replace("<|", "<\u200b|")


class Judge:
    """The `judge` reward function: a RewardInput in, the judge's score / max_score out."""

    reward_range = (0.0, 1.0)  # the reward service fails anything else

    def __init__(self, cfg: JudgeConfig):
        self.cfg, self.pattern = cfg, re.compile(cfg.pattern)
        self.client: Any = None  # made on first use, on the event loop that uses it
        self.model = cfg.model

    async def __call__(self, s: RewardInput) -> float:
        import openai

        prompt = self.cfg.rubric.format(
            **{**s.task, "prompt": s.prompt, "answer": s.answer, "completion": as_text(s.completion)}
        )
        try:
            if self.client is None:
                self.client = openai.AsyncOpenAI(
                    base_url=self.cfg.base_url,
                    api_key=self.cfg.api_key,
                    timeout=self.cfg.timeout_s,
                    max_retries=self.cfg.retries,
                )
            if self.model is None:
                self.model = (await self.client.models.list()).data[0].id
            r = await self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                temperature=self.cfg.temperature,
                max_tokens=self.cfg.max_tokens,
                extra_body=self.cfg.extra_body or None,
            )
        except (openai.BadRequestError, openai.UnprocessableEntityError) as e:
            # the sample's own request (too long for the judge's context): the sample fails, scored
            # as a wrong one; unavailable would drop its group and spare it
            raise ValueError(f"the judge refused the request this sample made: {e}") from e
        except openai.APIError as e:  # connection, timeout, HTTP status: the judge failed, not the answer
            raise RewardUnavailable("judge", f"judge at {self.cfg.base_url}: {type(e).__name__}: {e}") from e
        if r.choices[0].finish_reason == "length" and self.pattern.search(s.completion):
            # cut short, its last score may be one it quotes from the response, not its verdict
            raise RewardUnavailable(
                "judge",
                f"the judge's answer was cut at rewards.judge.max_tokens ({self.cfg.max_tokens}), "
                "and the response writes a score it may be quoting",
            )
        text = r.choices[0].message.content or ""
        found = self.verdict(text)
        try:
            score = float(found.group(1))  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            raise RewardUnavailable(
                "judge", f"no score in the judge's answer (config key 'rewards.judge.pattern'): {text[:80]!r}"
            ) from None
        return min(1.0, max(0.0, score / self.cfg.max_score))

    def verdict(self, text: str) -> re.Match | None:
        """The score `pattern` finds last outside the judge's thoughts: its verdict comes after
        any score it quotes from the response."""
        found = list(self.pattern.finditer(after_thinking(text)))
        return found[-1] if found else None
