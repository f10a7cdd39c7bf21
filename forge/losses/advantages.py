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
    teacher scores."""
    like = batch.gen_logprobs
    weights = [torch.as_tensor(w, dtype=like.dtype).expand_as(like) for w in weights]
    total = sum(weights)
    teacher = sum(w * lp.to(like) for w, lp in zip(weights, teacher_logprobs)) / total.clamp(min=1e-12)
    reverse_kl = (like - teacher) * batch.loss_mask * (total > 0)
    return -coef * reverse_kl, reverse_kl


def gae(
    batch: Batch,
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over each episode's own tokens (loss mask 1) in order:
    the environment's tokens of a multi-turn episode are skipped, neither steps nor values. The
    episode's reward (`rewards`, [episodes]) comes at its last such token; after it the return is
    0, or `bootstrap` ([episodes]: the value after the last token, for an episode cut short).
    delta_i = r_i + gamma V_(i+1) - V_i, A_i = delta_i + gamma lam A_(i+1). Returns (advantages,
    returns = advantages + values) [rows, seq], 0 off the episode's tokens."""
    advantages = torch.zeros_like(values)
    after = torch.zeros_like(rewards) if bootstrap is None else bootstrap.to(values)
    own = (batch.loss_mask > 0) & (batch.doc_ids >= 0)
    for doc in range(batch.num_episodes):
        where = (own & (batch.doc_ids == doc)).nonzero(as_tuple=True)  # row-major: the tokens in order
        v = values[where]
        if v.numel() == 0:
            continue
        nxt = torch.cat([v[1:], after[doc].reshape(1)])
        r = torch.zeros_like(v)
        r[-1] = rewards[doc]
        delta = r + gamma * nxt - v
        out = torch.zeros_like(v)
        running = v.new_zeros(())
        for i in range(v.numel() - 1, -1, -1):
            running = delta[i] + gamma * lam * running
            out[i] = running
        advantages[where] = out
    return advantages, (advantages + values) * own.to(values.dtype)


def _masked_var(x: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of `x` over the `n` entries where `m` is 1."""
    mean = (x * m).sum() / n
    return mean, (((x - mean) * m) ** 2).sum() / n


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`x` with mean 0 and std 1 over the `mask`ed entries (PPO's per-batch advantage
    whitening), 0 elsewhere."""
    m = mask.to(x.dtype)
    mean, var = _masked_var(x, m, m.sum().clamp(min=1))
    return (x - mean) * torch.rsqrt(var + eps) * m


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the `mask`ed entries: 1 when the values
    predict the returns, 0 for a constant guess, negative when they mislead (nan: returns
    without variance)."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1)
    spread = _masked_var(returns, m, n)[1]
    return float(1 - _masked_var(returns - values, m, n)[1] / spread) if spread > 0 else float("nan")
