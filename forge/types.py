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
    # The prompt ends with a reasoning block's opening tag (<think>, a chat template's such as
    # DeepSeek-R1's): the text starts inside that block, which its own tags do not show.
    thinking: bool = False
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
    thinking: bool = False  # the completion starts inside a <think> block its prompt opened

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


# The largest reward: advantages are made in float32, where a larger value is inf.
MAX_REWARD = float(torch.finfo(torch.float32).max)
GREEDY_BELOW = 1e-5  # vLLM samples a request whose temperature is below this greedily


def check_reward(value: float, where: str, bounds: tuple[float, float] | None = None) -> float:
    """`value` when it is finite (as a float32) and within `bounds`, else a ValueError naming `where`."""
    if not math.isfinite(value):
        raise ValueError(f"{where} is {value}, not a finite number")
    if abs(value) > MAX_REWARD:
        raise ValueError(f"{where} is {value}, past float32's range (forge.types.MAX_REWARD, {MAX_REWARD:.4g})")
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
    def coerce(cls, value: Any, where: str, loose: bool = False, check: bool = True) -> Score:
        """`value` as a Score: a Score, or a mapping of its fields (`reward` required), its reward
        and components finite. Anything else is a TypeError that says what `where` returned and
        which field is wrong.

        `loose` is for what a reward function or an agent returns: also a number (the reward),
        and a mapping's other keys are named components, its `reward` defaulting to their sum.
        `check=False` leaves the values to the caller (`checked`): one that is not finite is
        then a ValueError of its own, not a wrong type."""
        try:
            score = cls._from(value, where, loose)
            return score.checked() if check else score
        except ValueError as e:
            raise TypeError(f"{where}: {e}") from None

    def checked(self) -> Score:
        """This Score when its reward and components pass `check_reward`, else a ValueError."""
        for k, v in self.components.items():
            check_reward(v, f"component {k!r}")
        check_reward(self.reward, "the reward")
        return self

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
    # Its group's place in the batch it was sampled into (ReplayBuffer.sample); -1: a group of its own.
    group: int = -1
    # One of the samples a multi-turn episode was recorded as, its turns in a line (services/gateway.py):
    # (the episode's id, this sample's place in it); None: a whole episode, or samples that branch.
    part: tuple[str, int] | None = None
    # Each token's sampling temperature, at which its gen_logprob is and the trainer's logprobs
    # are computed (1 on tokens not sampled); None: 1 everywhere.
    temperatures: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "gen_logprobs", "routed_experts", "temperatures"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"Episode.{name} has {len(value)} entries for {n} tokens")

    @classmethod
    def from_completion(cls, c: Completion, **kw: Any) -> Episode:
        p, t = len(c.prompt_ids), logprob_temperature(c.sampling.get("temperature", 1.0))
        return cls(
            tokens=list(c.prompt_ids) + list(c.token_ids),
            loss_mask=[0] * p + [1] * len(c.token_ids),
            gen_logprobs=[0.0] * p + list(c.logprobs),
            policy_version=c.policy_version,
            routed_experts=c.routed_experts,
            temperatures=None if t == 1.0 else [1.0] * p + [t] * len(c.token_ids),
            **kw,
        )

    @property
    def reward(self) -> float:
        return self.score.reward

    @property
    def num_response_tokens(self) -> int:
        return sum(self.loss_mask)


def logprob_temperature(temperature: float | None) -> float:
    """The temperature a sampled token's logprob is at: its request's, or 1 for a greedy request
    (vLLM computes a greedy request's logprobs from the plain logits)."""
    return 1.0 if temperature is None or temperature < GREEDY_BELOW else float(temperature)


def continued(episodes: Sequence[Episode]) -> torch.Tensor:
    """[episodes] bool: whether episode i goes on in episode i + 1, the next sample of the same
    multi-turn episode (`Episode.part`): its return is that sample's, not 0 after its last token."""
    return torch.tensor([_goes_on(a, b) for a, b in zip(episodes, [*episodes[1:], None])], dtype=torch.bool)


def _goes_on(a: Episode, b: Episode | None) -> bool:
    return a.part is not None and b is not None and b.part == (a.part[0], a.part[1] + 1)


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
    # long, on rows where episodes share their group's prompt (collate's `share_prefix`): the
    # segment of each token, which says what it attends to (`sees`); None: `positions` say it.
    segments: torch.Tensor | None = None
    # float, each token's sampling temperature (Episode.temperatures), where some episode was
    # sampled at another than 1; None: 1 everywhere.
    temperatures: torch.Tensor | None = None
    # float, [episodes]: the loss tokens of the whole episode each is part of, where an episode
    # was recorded as several samples (Episode.part): the per-episode losses weigh such an episode
    # once, each sample by its share of its tokens (forge.losses); None: each sample is its episode.
    episode_tokens: torch.Tensor | None = None

    @property
    def num_episodes(self) -> int:
        return int(self.policy_versions.numel())

    @property
    def longest_episode(self) -> int:
        """The longest episode's token count: the row width of one episode per row, whatever the layout."""
        if self.positions is None:
            return int(self.input_ids.shape[1])
        own = self.doc_ids >= 0
        return int(self.positions[own].max()) + 1 if bool(own.any()) else 0

    def to(self, device: torch.device | str) -> Batch:
        moved = {
            f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None else None)
            for f in fields(self)
        }
        return Batch(**moved)


def collate(
    episodes: Sequence[Episode],
    pad_id: int,
    pack_to: int = 0,
    rows_multiple_of: int = 1,
    keep_together: int = 1,
    share_prefix: bool | Literal["always"] = False,
) -> Batch:
    """One episode per row, padded to the longest; or, with `pack_to`, episodes packed into
    rows of up to `pack_to` tokens (first fit, longest first; a longer episode gets a row of its
    own), each attending only within itself (`positions`). `keep_together` consecutive episodes
    (a preference pair: 2) always share a row, in order. With `share_prefix`, episodes whose
    tokens before their first loss token are the same (a group's prompt) are laid out as one
    unit: that prompt once, then each episode's own tokens, which see the prompt and themselves
    only (`segments`), where that costs less (`shared_units`; "always": wherever they can be).
    Empty rows make the row count a multiple of
    `rows_multiple_of` (the trainer's ranks x micro-batches: a batch of whole groups holds any
    number of episodes). Episode i is doc i and policy_versions[i]."""
    if not episodes:
        raise ValueError("collate() got no episodes")
    if len(episodes) % keep_together:
        raise ValueError(f"collate(): {len(episodes)} episodes are not units of keep_together={keep_together}")
    if share_prefix:
        units = shared_units(episodes, keep_together, pack_to, only_cheaper=share_prefix != "always")
    else:
        units = [_Unit(list(range(i, i + keep_together))) for i in range(0, len(episodes), keep_together)]
    shared = any(u.prompt for u in units)
    rows = [_pieces(row, episodes) for row in _pack(units, [u.length(episodes) for u in units], pack_to)]
    rows += [[] for _ in range(-len(rows) % rows_multiple_of)]
    width = max(sum(p.stop - p.start for p in row) for row in rows)
    shape = (len(rows), width)
    b = dict(
        input_ids=torch.full(shape, pad_id, dtype=torch.long),
        loss_mask=torch.zeros(shape),
        advantages=torch.zeros(shape),
        gen_logprobs=torch.zeros(shape),
        doc_ids=torch.full(shape, -1, dtype=torch.long),
    )
    if any(e.temperatures is not None for e in episodes):
        b["temperatures"] = torch.ones(shape)
    # Padding continues the row's last positions and segment, so it starts no episode of its own.
    positions = torch.arange(width).repeat(len(rows), 1)
    segments = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for p in row:
            ep, s, t = episodes[p.episode], slice(col, col + p.stop - p.start), slice(p.start, p.stop)
            b["input_ids"][r, s] = torch.tensor(ep.tokens[t])
            if not p.shared:  # a shared prompt is every member's and none's: doc -1, no loss
                b["loss_mask"][r, s] = torch.tensor(ep.loss_mask[t], dtype=torch.float)
                b["advantages"][r, s] = ep.advantage
                b["gen_logprobs"][r, s] = torch.tensor(ep.gen_logprobs[t])
                b["doc_ids"][r, s] = p.episode
                if ep.temperatures is not None:
                    b["temperatures"][r, s] = torch.tensor(ep.temperatures[t])
            positions[r, col:] = torch.arange(p.start, p.start + width - col)
            segments[r, col:] = p.segment
            col = s.stop
    versions = torch.tensor([e.policy_version for e in episodes], dtype=torch.long)
    return Batch(
        **b,
        ref_logprobs=None,
        policy_versions=versions,
        episode_tokens=_episode_tokens(episodes),
        positions=positions if pack_to or keep_together > 1 or shared else None,
        routed_experts=_routed_experts(episodes, rows, width),
        segments=segments if shared else None,
    )


def _episode_tokens(episodes: Sequence[Episode]) -> torch.Tensor | None:
    """Batch.episode_tokens: each sample's whole episode's loss tokens (its chain of `continued`
    samples), or None when no sample goes on in another."""
    goes_on = continued(episodes)
    if not goes_on.any():
        return None
    own = torch.tensor([float(sum(e.loss_mask)) for e in episodes])
    chain = torch.cat([torch.zeros(1, dtype=torch.long), (~goes_on[:-1]).long()]).cumsum(0)  # each one's chain
    return torch.zeros(int(chain[-1]) + 1).index_add(0, chain, own)[chain]


# Batch.segments: member k (k >= 1) of unit u is segment u x MEMBERS + k, the unit's shared
# prompt u x MEMBERS; an episode laid out whole is a unit of its own.
MEMBERS = 1 << 20


def sees(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Whether a token of segment `query` may attend to an earlier token of segment `key`: one of
    its own segment, or of its unit's shared prompt (broadcasting; the causal order is the
    caller's). The one rule of Batch.segments, for dense masks and flex's mask_mod alike."""
    return (key == query) | (key == query // MEMBERS * MEMBERS)


@dataclass
class _Unit:
    """Episodes laid out together in a row: their first `prompt` tokens once (the same in all of
    them; 0: nothing shared), then each episode's tokens from there."""

    episodes: list[int]
    prompt: int = 0

    def length(self, episodes: Sequence[Episode]) -> int:
        return self.prompt + sum(len(episodes[i].tokens) - self.prompt for i in self.episodes)


@dataclass
class _Piece:
    """Tokens [start, stop) of one episode at their place in a row, in segment `segment`."""

    episode: int
    start: int
    stop: int
    segment: int
    shared: bool = False


def _pieces(row: list[_Unit], episodes: Sequence[Episode]) -> list[_Piece]:
    """A row's units as pieces, in order; each unit (and each episode of an unshared one) its own
    unit number in the row's segments."""
    out: list[_Piece] = []
    for unit in row:
        if unit.prompt:
            u = len(out)  # unit numbers only need to differ within the row
            out.append(_Piece(unit.episodes[0], 0, unit.prompt, u * MEMBERS, shared=True))
            out += [
                _Piece(i, unit.prompt, len(episodes[i].tokens), u * MEMBERS + k + 1)
                for k, i in enumerate(unit.episodes)
            ]
        else:
            out += [
                _Piece(i, 0, len(episodes[i].tokens), (len(out) + k) * MEMBERS) for k, i in enumerate(unit.episodes)
            ]
    return out


def shared_prompt(episode: Episode) -> int:
    """How many of `episode`'s first tokens a unit may share: those before its first loss token,
    less the last of them, which each member keeps (its output predicts the member's first own
    token, and a member's tokens see only the shared prompt and themselves)."""
    first = next((t for t, m in enumerate(episode.loss_mask) if m), len(episode.tokens))
    return max(first - 1, 0)


def shared_units(
    episodes: Sequence[Episode], keep_together: int = 1, pack_to: int = 0, only_cheaper: bool = True
) -> list[_Unit]:
    """The episodes, `keep_together` at a time, as units that share their prompt (the same tokens
    before the first loss token, and a MoE's recorded routes there), in order of first
    appearance; a unit over `pack_to` tokens is split into several, each with its prompt. A lone
    episode is laid out whole, and with `only_cheaper` so is a unit whose shared row attends over
    more than its episodes' rows would (rows^2, what a dense mask computes: long prompts with
    short answers share, the reverse not)."""
    by_prompt: dict[tuple, list[int]] = {}
    for start in range(0, len(episodes), keep_together):
        members = list(range(start, start + keep_together))
        p = min(shared_prompt(episodes[i]) for i in members)
        prompts = {_prompt_of(episodes[i], p) for i in members}
        # Without a prompt to share, or with its own episodes differing there: laid out whole, alone.
        key = ("prompt", p, *prompts.pop()) if len(prompts) == 1 and p else ("whole", start)
        by_prompt.setdefault(key, []).extend(members)
    units: list[_Unit] = []
    for key, members in by_prompt.items():
        p = key[1] if key[0] == "prompt" and len(members) > 1 else 0
        unit = _Unit([], p)
        for start in range(0, len(members), keep_together):
            grown = _Unit(unit.episodes + members[start : start + keep_together], p)
            if unit.episodes and pack_to and grown.length(episodes) > pack_to:
                units.append(unit)
                grown = _Unit(members[start : start + keep_together], p)
            unit = grown
        units.append(unit)
    if only_cheaper:  # the others as collate lays them out without sharing
        units = [v for u in units for v in ([u] if _cheaper(u, episodes, keep_together) else _whole(u, keep_together))]
    return units


def _prompt_of(episode: Episode, p: int) -> tuple[tuple[int, ...], bytes | None]:
    """What the episodes of a unit have alike in their first `p` tokens: the tokens, and a MoE's
    recorded routes (the shared prompt replays one member's for all)."""
    routes = episode.routed_experts
    return tuple(episode.tokens[:p]), (None if routes is None else routes[:p].long().numpy().tobytes())


def _whole(unit: _Unit, keep_together: int) -> list[_Unit]:
    return [_Unit(unit.episodes[i : i + keep_together]) for i in range(0, len(unit.episodes), keep_together)]


def _cheaper(unit: _Unit, episodes: Sequence[Episode], keep_together: int) -> bool:
    """Whether `unit`'s row attends over no more token pairs than its episodes laid out whole."""
    whole = sum(u.length(episodes) ** 2 for u in _whole(unit, keep_together))
    return not unit.prompt or unit.length(episodes) ** 2 <= whole


def _pack(units: list[_Unit], lengths: list[int], pack_to: int) -> list[list[_Unit]]:
    """The units by row: a unit a row, or with `pack_to` first fit, longest first."""
    if not pack_to:
        return [[u] for u in units]
    rows: list[list[_Unit]] = []
    used: list[int] = []
    for k in sorted(range(len(units)), key=lambda k: -lengths[k]):
        fit = next((r for r, u in enumerate(used) if u + lengths[k] <= pack_to), None)
        if fit is None:
            rows.append([units[k]])
            used.append(lengths[k])
        else:
            rows[fit].append(units[k])
            used[fit] += lengths[k]
    return rows


def _routed_experts(episodes: Sequence[Episode], rows: list[list[_Piece]], width: int) -> torch.Tensor | None:
    """The episodes' routing records laid out as collate lays out their tokens (-1 elsewhere); a
    shared prompt's are its first member's."""
    shapes = {tuple(e.routed_experts.shape[1:]) for e in episodes if e.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"collate: episodes' routed_experts have different [layers, top_k]: {sorted(shapes)}")
    out = torch.full((len(rows), width, *shapes.pop()), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for p in row:
            record = episodes[p.episode].routed_experts
            if record is not None:
                out[r, col : col + p.stop - p.start] = record[p.start : p.stop]
            col += p.stop - p.start
    return out
