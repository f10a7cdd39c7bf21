"""Advantages: how much better than expected each sampled token was, from what a run has.

    group_advantages(rewards)                         # GRPO: an episode's reward against its group's
    teacher_advantages(batch, teacher_logprobs, ...)  # distillation: a teacher's per-token judgement
    gae(batch, values, rewards, gamma, lam)           # PPO: a critic's values, Generalized Advantage Estimation
    explained_variance(values, returns, mask)         # how much of the returns the critic's values explain

Token-aligned as everything in a Batch: index t is token t, and a value at t is the critic's
estimate of the episode's return before token t is sampled (read, as a logprob, from the
model's output at t - 1).
"""

from __future__ import annotations

import torch

from forge.types import Batch


def group_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages for one group: reward minus the group mean (divided by the group std
    unless Dr.GRPO's std_normalize=False); exactly 0 for a group whose rewards are all equal
    (in fp32 the mean of four 0.7s is not 0.7: that rounding, over a std of its own size, would
    give every sample an advantage of about 0.06, its sign by chance)."""
    if rewards.numel() == 0 or bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards, dtype=torch.get_default_dtype())
    r = rewards.double()
    adv = r - r.mean()
    if std_normalize:
        adv = adv / (r.std(unbiased=False) + eps)
    return adv.to(torch.get_default_dtype())


def teacher_advantages(
    batch: Batch, teacher_logprobs: list[torch.Tensor], weights: list[float | torch.Tensor], coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: each sampled token's advantage `coef` x (log p_teacher - log
    p_student), the per-token reverse KL's negative, where p_student is the policy that sampled
    the token (`gen_logprobs`: right under any staleness) and p_teacher mixes the teachers'
    logprobs by `weights`: a number per teacher, or a [rows, seq] tensor (0 on the tokens it
    does not score, e.g. another data source's). Returns (advantages, reverse KL) [rows, seq], 0
    off the loss tokens (prompts, and an agentic episode's environment tokens) and on tokens no
    teacher scores, whatever a teacher's logprob there (a NaN of a token nobody reads stays out).
    Non-finite where a teacher scores a loss token: the caller drops that episode's group."""
    like = batch.gen_logprobs
    # In float64: any weight a config accepts (> 0) stays > 0 and mixes in its proportion.
    weights = [torch.as_tensor(w, dtype=torch.float64).expand_as(like) for w in weights]
    # Over the largest at each token, each in [0, 1]: weight x logprob and their sum stay finite
    # however large the weights (1e308 x a logprob of -2 is -inf).
    top = torch.stack(weights).amax(0)
    weights = [w / torch.where(top > 0, top, 1.0) for w in weights]
    total = sum(weights)
    mixed = sum(torch.where(w > 0, w * lp.double(), 0.0) for w, lp in zip(weights, teacher_logprobs))
    teacher = (mixed / torch.where(total > 0, total, 1.0)).to(like.dtype)
    reverse_kl = torch.where((batch.loss_mask > 0) & (total > 0), like - teacher, 0.0)
    return -coef * reverse_kl, reverse_kl


def gae(
    batch: Batch,
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    bootstrap: torch.Tensor | None = None,
    continues: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over each episode's own tokens (loss mask 1) in order:
    the environment's tokens of a multi-turn episode are skipped, neither steps nor values. The
    episode's reward (`rewards`, [episodes]) comes at its last such token; after it the return is
    0, or `bootstrap` ([episodes]: the value after the last token, for an episode cut short).
    With `continues` ([episodes] bool, forge.types.continued), episode i that goes on in episode
    i + 1 (one multi-turn episode recorded as several samples) is one episode with it: its last
    token steps to the next one's first, and only the last sample's reward and bootstrap count.
    delta_i = r_i + gamma V_(i+1) - V_i, A_i = delta_i + gamma lam A_(i+1). Returns (advantages,
    returns = advantages + values) [rows, seq], 0 off the episode's tokens (whatever the values there)."""
    advantages = torch.zeros_like(values)
    after = torch.zeros_like(rewards) if bootstrap is None else bootstrap.to(values)
    own = (batch.loss_mask > 0) & (batch.doc_ids >= 0)
    rows, cols, starts = _tokens_by_episode(batch, own)
    for docs in _chains(batch.num_episodes, continues):
        # a chain's samples are consecutive episodes: their tokens one slice, in order
        lo, hi = starts[docs[0]], starts[docs[-1] + 1]
        if lo == hi:
            continue
        where = (rows[lo:hi], cols[lo:hi])
        advantages[where] = _gae_steps(values[where], rewards[docs[-1]], after[docs[-1]], gamma, lam)
    return advantages, torch.where(own, advantages + values, 0.0)


def _tokens_by_episode(batch: Batch, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The `own` tokens' (rows, cols), grouped by episode and row-major within one (its tokens in
    order), and where each episode's start: episode d is [starts[d], starts[d + 1]). One sort,
    not a scan of the whole batch per episode."""
    rows, cols = own.nonzero(as_tuple=True)
    docs, order = torch.sort(batch.doc_ids[rows, cols], stable=True)
    bounds = torch.arange(batch.num_episodes + 1, device=docs.device)
    return rows[order], cols[order], torch.searchsorted(docs, bounds).tolist()


def _chains(episodes: int, continues: torch.Tensor | None) -> list[list[int]]:
    """The episodes as runs of the samples of one episode: [0, 1], [2], ... (`continues[i]`: i
    goes on in i + 1)."""
    chains: list[list[int]] = []
    for doc in range(episodes):
        if not (doc and continues is not None and bool(continues[doc - 1])):
            chains.append([])
        chains[-1].append(doc)
    return chains


def _gae_steps(v: torch.Tensor, reward: torch.Tensor, after: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """GAE over one episode's values `v` in order, `reward` at its last step, `after` the value
    after it. In Python floats (float64): the recursion is sequential, and a tensor op per
    token costs ~30 us, a minute for a batch of a million tokens."""
    vals = v.tolist()
    nxt = [*vals[1:], float(after)]
    out = [0.0] * len(vals)
    running, last = 0.0, len(vals) - 1
    for i in range(last, -1, -1):
        delta = (float(reward) if i == last else 0.0) + gamma * nxt[i] - vals[i]
        running = delta + gamma * lam * running
        out[i] = running
    return torch.tensor(out, dtype=v.dtype, device=v.device)


def finite_episodes(batch: Batch, x: torch.Tensor) -> torch.Tensor:
    """[episodes] bool: whether `x` ([rows, seq]) is finite on every loss token of each episode."""
    bad = ~x.isfinite() & (batch.loss_mask > 0) & (batch.doc_ids >= 0)
    finite = torch.ones(batch.num_episodes, dtype=torch.bool)
    finite[batch.doc_ids[bad]] = False
    return finite


def _masked_var(x: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of `x` over the `n` entries where `m` is 1 (what `x` holds elsewhere,
    a NaN too, never counts)."""
    on = m > 0
    mean = torch.where(on, x, 0.0).sum() / n
    return mean, torch.where(on, x - mean, 0.0).pow(2).sum() / n


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`x` with mean 0 and std 1 over the `mask`ed entries (PPO's per-batch advantage
    whitening), 0 elsewhere."""
    # float64: the squares of advantages of any reward a run accepts (up to float32's largest)
    # overflow float32, and a variance of inf would whiten the whole batch to 0.
    m, x64 = mask.to(torch.float64), x.double()
    mean, var = _masked_var(x64, m, m.sum().clamp(min=1))
    return torch.where(m > 0, (x64 - mean) * torch.rsqrt(var + eps), 0.0).to(x.dtype)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the `mask`ed entries: 1 when the values
    predict the returns, 0 for a constant guess, negative when they mislead (nan: returns
    without variance)."""
    # float64, as `whiten`: squares of float32 returns may overflow it
    m, values, returns = mask.to(torch.float64), values.double(), returns.double()
    n = m.sum().clamp(min=1)
    spread = _masked_var(returns, m, n)[1]
    return float(1 - _masked_var(returns - values, m, n)[1] / spread) if spread > 0 else float("nan")
