"""The data that flows through forge: Completion -> Score -> Episode -> Batch. One definition each.

Token-aligned lists use one convention everywhere: index t describes token t of the
sequence (the prompt included). A model's logits at t-1 predict token t, so the trainer
shifts once, in one place, and nobody else has to think about it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

import torch

FinishReason = Literal["stop", "length", "abort", "tool_call", "error"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Completion:
    """One sampled response, as the generator returns it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the sampling distribution
    text: str
    finish_reason: FinishReason
    sampling: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0  # weights the request was admitted under (the oldest used)
    max_policy_version: int | None = None  # newest weights used, if a reload landed mid-request
    prompt: str | None = None
    # MoE with routing replay: the experts each layer routed each token to, [prompt + completion
    # tokens, layers, top_k] int16, -1 where the generator computed none (the trainer routes those).
    routed_experts: torch.Tensor | None = None
    # Asked for (sampling `prompt_logprobs: k`): each prompt position's logprob of its token and of
    # the k likeliest, {token id: logprob}; None at position 0, which nothing predicts.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"Completion: {len(self.logprobs)} logprobs for {len(self.token_ids)} tokens")
        if self.max_policy_version is None:
            self.max_policy_version = self.policy_version


@dataclass
class RewardInput:
    """What a reward function sees of one sample."""

    task: dict[str, Any]  # the dataset row: prompt, answer, task, and a dataset file's other columns
    completion: str  # the policy's text (in a multi-turn episode, its last message)
    finish_reason: str = "stop"
    messages: list[dict[str, Any]] | None = None  # a multi-turn episode's whole conversation

    @property
    def prompt(self) -> str:
        return self.task["prompt"]

    @property
    def answer(self) -> str:
        return self.task["answer"]


class RewardUnavailable(RuntimeError):
    """Raised by a reward (built-in or a user's) whose infrastructure failed: a sandbox crashed, a
    judge is unreachable or answered nothing parseable. The sample's reward is unknown, not wrong:
    its Score says `unavailable` (`kind`), and GRPO masks its group or scores it 0
    (`reward_unavailable`)."""

    def __init__(self, kind: str, message: str = ""):
        super().__init__(message or f"{kind} unavailable")
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:  # pickles with its kind (across processes)
        return type(self), (self.kind, str(self))


def reward_range(low: float, high: float) -> Callable[[F], F]:
    """Declares the values a reward function returns (`@reward_range(0, 1)`, or a class attribute
    `reward_range = (0.0, 1.0)`). The reward service fails any value outside it, so a bug or a
    graded program that inflates its own count scores 0 for its sample instead of dominating
    its group."""

    def declare(fn: F) -> F:
        fn.reward_range = (float(low), float(high))  # type: ignore[attr-defined]
        return fn

    return declare


def check_reward(value: float, where: str, bounds: tuple[float, float] | None = None) -> float:
    """`value` when it is finite and within `bounds`, else a ValueError naming `where`."""
    if not math.isfinite(value):
        raise ValueError(f"{where} is {value}, not a finite number")
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{where} is {value}, outside its declared range [{bounds[0]}, {bounds[1]}]")
    return value


@dataclass
class Score:
    """What the reward service, or a custom rollout, says of one sample."""

    reward: float  # the weighted total GRPO trains on
    components: dict[str, float] = field(default_factory=dict)  # each named reward, unweighted
    correct: float | None = None  # 1/0 for a verified answer (the `accuracy` metric); None: not known
    error: str | None = None  # why a reward function failed (it then scored 0 for this sample)
    unavailable: str | None = None  # the kind of a RewardUnavailable (then `error` says why)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @classmethod
    def coerce(cls, value: Any, where: str, loose: bool = False) -> Score:
        """`value` as a Score: a Score, or a mapping of its fields (`reward` required), its reward
        and components finite. Anything else is a TypeError that says what `where` returned and
        which field is wrong.

        `loose` is for what a reward function or an agent returns: also a number (the reward),
        and a mapping's other keys are named components, its `reward` defaulting to their sum."""
        try:
            score = cls._from(value, where, loose)
            for k, v in score.components.items():
                check_reward(v, f"component {k!r}")
            check_reward(score.reward, "the reward")
            return score
        except ValueError as e:
            raise TypeError(f"{where}: {e}") from None

    @classmethod
    def _from(cls, value: Any, where: str, loose: bool) -> Score:
        if isinstance(value, cls):
            return value
        names = [f.name for f in fields(cls)]
        if loose and isinstance(value, (int, float)):
            return cls(float(value))
        if not isinstance(value, Mapping):
            wanted = "a number, a dict or a forge.types.Score" if loose else "a forge.types.Score"
            raise TypeError(f"{where} is a {type(value).__name__}, not {wanted} (fields: {', '.join(names)})")
        named = {k: v for k, v in value.items() if k not in names}
        if not loose and "reward" not in value:
            raise TypeError(f"{where} has no field 'reward' (a Score needs it; got {sorted(value)})")
        if not loose and named:
            raise TypeError(f"{where} has unknown field(s) {sorted(named)}; a Score has {', '.join(names)}")
        try:
            components = {k: float(v) for k, v in {**dict(value.get("components") or {}), **named}.items()}
            return cls(
                reward=float(value["reward"]) if "reward" in value else sum(components.values()),
                components=components,
                correct=None if value.get("correct") is None else float(value["correct"]),
                error=value.get("error"),
                unavailable=value.get("unavailable"),
            )
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}: {e}") from None


@dataclass
class Episode:
    """One trajectory to train on: all turns flattened into one token sequence."""

    tokens: list[int]
    loss_mask: list[int]  # 1 where the policy produced the token, 0 for prompt / tool output
    gen_logprobs: list[float]  # generator logprob of each token (0 where loss_mask is 0)
    advantage: float = 0.0
    policy_version: int = 0
    score: Score = field(default_factory=lambda: Score(0.0))
    routed_experts: torch.Tensor | None = None  # [tokens, layers, top_k], as in Completion
    task: str = ""  # the data source of its prompt (`Sample.task`)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "gen_logprobs", "routed_experts"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"Episode.{name} has {len(value)} entries for {n} tokens")

    @classmethod
    def from_completion(cls, c: Completion, **kw: Any) -> Episode:
        p = len(c.prompt_ids)
        return cls(
            tokens=list(c.prompt_ids) + list(c.token_ids),
            loss_mask=[0] * p + [1] * len(c.token_ids),
            gen_logprobs=[0.0] * p + list(c.logprobs),
            policy_version=c.policy_version,
            routed_experts=c.routed_experts,
            **kw,
        )

    @property
    def reward(self) -> float:
        return self.score.reward

    @property
    def num_response_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Batch:
    """Tensors for one trainer step, [rows, seq] unless noted. Built only by `collate`."""

    input_ids: torch.Tensor  # long
    loss_mask: torch.Tensor  # float, 1 on tokens the loss sees
    advantages: torch.Tensor  # float, the episode's advantage on each of its tokens
    gen_logprobs: torch.Tensor  # float
    ref_logprobs: torch.Tensor | None  # float, the reference model's (set after collate), or None
    doc_ids: torch.Tensor  # long, episode index of each token, -1 on padding
    policy_versions: torch.Tensor  # long, [episodes]
    # long, each token's position in its own episode (0 where one starts), on packed rows only;
    # None: one episode per row, from column 0.
    positions: torch.Tensor | None = None
    # long, [rows, seq, layers, top_k]: the experts the generator routed each token to, replayed
    # by the trainer (-1: route it yourself); None: no episode has a record.
    routed_experts: torch.Tensor | None = None
    # float, a critic's (PPO): its values of each token as the batch was made, and the returns
    # it learns (forge.losses.advantages.gae); None elsewhere.
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def num_episodes(self) -> int:
        return int(self.policy_versions.numel())

    def to(self, device: torch.device | str) -> Batch:
        moved = {
            f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None else None)
            for f in fields(self)
        }
        return Batch(**moved)


def collate(
    episodes: Sequence[Episode], pad_id: int, pack_to: int = 0, rows_multiple_of: int = 1, keep_together: int = 1
) -> Batch:
    """One episode per row, padded to the longest; or, with `pack_to`, episodes packed into
    rows of up to `pack_to` tokens (first fit, longest first; a longer episode gets a row of its
    own), each attending only within itself (`positions`). `keep_together` consecutive episodes
    (a preference pair: 2) always share a row, in order. Empty rows make the row count a
    multiple of `rows_multiple_of` (the trainer's ranks x micro-batches: a batch of whole groups
    holds any number of episodes). Episode i is doc i and policy_versions[i]."""
    if not episodes:
        raise ValueError("collate() got no episodes")
    if len(episodes) % keep_together:
        raise ValueError(f"collate(): {len(episodes)} episodes are not units of keep_together={keep_together}")
    units = [list(range(i, i + keep_together)) for i in range(0, len(episodes), keep_together)]
    rows = _pack(units, [sum(len(episodes[i].tokens) for i in u) for u in units], pack_to)
    rows += [[] for _ in range(-len(rows) % rows_multiple_of)]
    width = max(sum(len(episodes[i].tokens) for i in row) for row in rows)
    shape = (len(rows), width)
    b = dict(
        input_ids=torch.full(shape, pad_id, dtype=torch.long),
        loss_mask=torch.zeros(shape),
        advantages=torch.zeros(shape),
        gen_logprobs=torch.zeros(shape),
        doc_ids=torch.full(shape, -1, dtype=torch.long),
    )
    # Padding continues the row's last positions, so it starts no episode of its own.
    positions = torch.arange(width).repeat(len(rows), 1)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            ep = episodes[i]
            s = slice(start, start + len(ep.tokens))
            b["input_ids"][r, s] = torch.tensor(ep.tokens)
            b["loss_mask"][r, s] = torch.tensor(ep.loss_mask, dtype=torch.float)
            b["advantages"][r, s] = ep.advantage
            b["gen_logprobs"][r, s] = torch.tensor(ep.gen_logprobs)
            b["doc_ids"][r, s] = i
            positions[r, start:] = torch.arange(width - start)
            start = s.stop
    versions = torch.tensor([e.policy_version for e in episodes], dtype=torch.long)
    routed = _routed_experts(episodes, rows, width)
    return Batch(
        **b,
        ref_logprobs=None,
        policy_versions=versions,
        positions=positions if pack_to or keep_together > 1 else None,
        routed_experts=routed,
    )


def _pack(units: list[list[int]], lengths: list[int], pack_to: int) -> list[list[int]]:
    """The units' episodes by row: a unit a row, or with `pack_to` first fit, longest first."""
    if not pack_to:
        return [list(u) for u in units]
    rows: list[list[int]] = []
    used: list[int] = []
    for k in sorted(range(len(units)), key=lambda k: -lengths[k]):
        fit = next((r for r, u in enumerate(used) if u + lengths[k] <= pack_to), None)
        if fit is None:
            rows.append(list(units[k]))
            used.append(lengths[k])
        else:
            rows[fit] += units[k]
            used[fit] += lengths[k]
    return rows


def _routed_experts(episodes: Sequence[Episode], rows: list[list[int]], width: int) -> torch.Tensor | None:
    """The episodes' routing records laid out as collate lays out their tokens (-1 elsewhere)."""
    shapes = {tuple(e.routed_experts.shape[1:]) for e in episodes if e.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"collate: episodes' routed_experts have different [layers, top_k]: {sorted(shapes)}")
    out = torch.full((len(rows), width, *shapes.pop()), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(episodes[i].tokens)
            if episodes[i].routed_experts is not None:
                out[r, start : start + n] = episodes[i].routed_experts
            start += n
    return out
