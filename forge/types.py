"""The data that flows through forge: Completion -> Episode -> Batch. One definition each.

Token-aligned lists use one convention everywhere: index t describes token t of the
sequence (the prompt included). A model's logits at t-1 predict token t, so the trainer
shifts once, in one place, and nobody else has to think about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, Sequence

import torch

FinishReason = Literal["stop", "length", "abort", "tool_call", "error"]


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

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"Completion: {len(self.logprobs)} logprobs for {len(self.token_ids)} tokens"
            )
        if self.max_policy_version is None:
            self.max_policy_version = self.policy_version

    @property
    def spans_versions(self) -> bool:
        return self.max_policy_version != self.policy_version


@dataclass
class Episode:
    """One trajectory to train on: all turns flattened into one token sequence."""

    tokens: list[int]
    loss_mask: list[int]  # 1 where the policy produced the token, 0 for prompt / tool output
    gen_logprobs: list[float]  # generator logprob of each token (0 where loss_mask is 0)
    reward: float = 0.0
    advantage: float = 0.0
    group_id: str = ""
    policy_version: int = 0
    ref_logprobs: list[float] | None = None
    rewards: dict[str, float] = field(default_factory=dict)  # components, for metrics
    completions: list[Completion] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "gen_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"Episode.{name} has {len(value)} entries for {n} tokens")

    @classmethod
    def from_completion(cls, c: Completion, group_id: str = "", **kw: Any) -> "Episode":
        p = len(c.prompt_ids)
        return cls(
            tokens=list(c.prompt_ids) + list(c.token_ids),
            loss_mask=[0] * p + [1] * len(c.token_ids),
            gen_logprobs=[0.0] * p + list(c.logprobs),
            group_id=group_id,
            policy_version=c.policy_version,
            completions=[c],
            **kw,
        )

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
    ref_logprobs: torch.Tensor | None  # float, or None if no episode had them
    position_ids: torch.Tensor  # long, restarts at 0 for every packed episode
    doc_ids: torch.Tensor  # long, episode index of each token, -1 on padding
    policy_versions: torch.Tensor  # long, [episodes]

    @property
    def num_episodes(self) -> int:
        return int(self.policy_versions.numel())

    def to(self, device: torch.device | str) -> "Batch":
        moved = {
            f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None else None)
            for f in fields(self)
        }
        return Batch(**moved)


def _rows(episodes: Sequence[Episode], pack: bool, max_len: int | None) -> list[list[int]]:
    """Which episodes go in which row: one each, or first-fit packing up to max_len."""
    if not pack:
        return [[i] for i in range(len(episodes))]
    if max_len is None:
        raise ValueError("collate(pack=True) needs max_len")
    rows: list[list[int]] = []
    room: list[int] = []
    for i, ep in enumerate(episodes):
        n = len(ep.tokens)
        if n > max_len:
            raise ValueError(f"episode {i} has {n} tokens, more than max_len={max_len}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_len - n)
    return rows


def collate(
    episodes: Sequence[Episode], pad_id: int, pack: bool = False, max_len: int | None = None
) -> Batch:
    """Pad (one episode per row) or pack (several per row, first fit) into a Batch."""
    if not episodes:
        raise ValueError("collate() got no episodes")
    rows = _rows(episodes, pack, max_len)
    width = max_len if pack else max(len(e.tokens) for e in episodes)
    if max_len is not None and not pack:
        longest = max(len(e.tokens) for e in episodes)
        if longest > max_len:
            raise ValueError(f"an episode has {longest} tokens, more than max_len={max_len}")
    shape = (len(rows), width)
    b = dict(
        input_ids=torch.full(shape, pad_id, dtype=torch.long),
        loss_mask=torch.zeros(shape),
        advantages=torch.zeros(shape),
        gen_logprobs=torch.zeros(shape),
        ref_logprobs=torch.zeros(shape),
        position_ids=torch.zeros(shape, dtype=torch.long),
        doc_ids=torch.full(shape, -1, dtype=torch.long),
    )
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            ep = episodes[i]
            n = len(ep.tokens)
            s = slice(start, start + n)
            b["input_ids"][r, s] = torch.tensor(ep.tokens)
            b["loss_mask"][r, s] = torch.tensor(ep.loss_mask, dtype=torch.float)
            b["advantages"][r, s] = ep.advantage
            b["gen_logprobs"][r, s] = torch.tensor(ep.gen_logprobs)
            if ep.ref_logprobs is not None:
                b["ref_logprobs"][r, s] = torch.tensor(ep.ref_logprobs)
            b["position_ids"][r, s] = torch.arange(n)
            b["doc_ids"][r, s] = i
            start += n
    with_ref = sum(e.ref_logprobs is not None for e in episodes)
    if with_ref == 0:
        b["ref_logprobs"] = None
    elif with_ref < len(episodes):
        raise ValueError(f"collate: {with_ref} of {len(episodes)} episodes have ref_logprobs; all or none must")
    versions = torch.tensor([e.policy_version for e in episodes], dtype=torch.long)
    return Batch(**b, policy_versions=versions)
