"""The `judge` reward: a model served through the OpenAI API grades each completion.

    rewards:
      weights: {judge: 1.0}
      judge: {base_url: http://127.0.0.1:8000/v1, model: qwen3-8b, max_score: 10}

The rubric is a template the sample fills in; `pattern` finds the score in the judge's answer,
divided by `max_score`. The judge is infrastructure: an unreachable endpoint, a timeout, an
HTTP error after `retries`, or an answer with no score makes the reward unavailable
(`RewardUnavailable("judge")`), never a wrong answer.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from forge.config import ConfigError
from forge.types import RewardInput, RewardUnavailable

RUBRIC = (
    "Grade the response against the reference answer.\n"
    "Question: {prompt}\nReference answer: {answer}\nResponse: {completion}\n"
    "Reply with 'Score: N', N from 0 (wrong) to 10 (fully right)."
)
SAMPLE_FIELDS = ("prompt", "completion", "answer", "task")  # besides a dataset file's columns


@dataclass
class JudgeConfig:
    """The `judge` section: the endpoint and rubric of the `judge` reward."""

    base_url: str | None = None  # an OpenAI API, e.g. `forge serve`'s http://127.0.0.1:8000/v1
    model: str | None = None  # None: the endpoint's first model
    api_key: str = "EMPTY"
    rubric: str = RUBRIC  # format fields: {prompt}, {completion}, {answer}, {task}, the dataset's columns
    pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"  # its one group is the score
    max_score: float = 10.0  # reward = score / max_score, clipped to [0, 1]
    temperature: float = 0.0
    max_tokens: int = 256
    timeout_s: float = 60.0  # one request
    retries: int = 2  # of a request that failed to connect, timed out or got 408/429/5xx
    # More request fields, e.g. vLLM's {structured_outputs: {regex: "Score: [0-9]+"}} or logit_bias.
    extra_body: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        try:
            groups = re.compile(self.pattern).groups
        except re.error as e:
            raise ConfigError(f"config key 'judge.pattern': {self.pattern!r} is not a regex: {e}") from None
        if groups != 1:
            raise ConfigError(f"config key 'judge.pattern' must have one group (the score), has {groups}")
        for key in ("max_score", "max_tokens", "timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key 'judge.{key}' must be > 0, got {getattr(self, key)}")
        if self.retries < 0:
            raise ConfigError(f"config key 'judge.retries' must be >= 0, got {self.retries}")
        self.check_rubric(None)

    def check(self, columns: Iterable[str] | None = None) -> None:
        """For a run whose rewards include `judge`: an endpoint, and a rubric whose fields the
        samples have (`columns`: a dataset file's, () for a toy task; None: not known yet)."""
        self.validate()
        if not self.base_url:
            raise ConfigError(
                "config key 'judge.base_url' is not set: the `judge` reward needs an OpenAI API endpoint "
                "(e.g. forge serve's http://127.0.0.1:8000/v1)"
            )
        self.check_rubric(columns)

    def check_rubric(self, columns: Iterable[str] | None) -> None:
        """The rubric parses as a template and, when `columns` are known, names only fields a sample has."""
        try:
            names = {field for _, field, _, _ in string.Formatter().parse(self.rubric) if field is not None}
        except ValueError as e:
            raise ConfigError(f"config key 'judge.rubric': {e}") from None
        roots = {re.split(r"[.\[]", n, maxsplit=1)[0] for n in names}
        if "" in roots:
            raise ConfigError("config key 'judge.rubric': name its fields ({completion}), not {} by position")
        known = None if columns is None else {*SAMPLE_FIELDS, *columns}
        if known is not None and roots - known:
            raise ConfigError(
                f"config key 'judge.rubric': unknown field(s) {sorted(roots - known)}; a sample has "
                f"{', '.join(sorted(known))}"
            )


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
            **{**s.task, "prompt": s.prompt, "answer": s.answer, "completion": s.completion}
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
        except openai.APIError as e:  # connection, timeout, HTTP status: the judge failed, not the answer
            raise RewardUnavailable("judge", f"judge at {self.cfg.base_url}: {type(e).__name__}: {e}") from e
        text = r.choices[0].message.content or ""
        found = self.pattern.search(text)
        try:
            score = float(found.group(1))  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            raise RewardUnavailable(
                "judge", f"no score in the judge's answer (config key 'rewards.judge.pattern'): {text[:80]!r}"
            ) from None
        return min(1.0, max(0.0, score / self.cfg.max_score))
