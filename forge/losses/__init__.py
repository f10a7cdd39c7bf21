"""Policy-gradient losses. Each is one small function of token-aligned [rows, seq] tensors:

    loss = LOSSES[cfg.name](logprobs, batch, is_weight, cfg)    # one scalar tensor

`logprobs` are the trainer's (with grad), index t = log p(token t); `is_weight` is the
importance weight, detached, that corrects what the generator sampled for the trainer's policy
(`IS_CORRECTIONS[cfg.is_correction]`: by default the token ratio pi_trainer / pi_generator
truncated at `is_cap`; ~1 on-policy, where only numerics differ). Each batch gets one optimizer step, so
the "old" policy of the PPO ratio is the trainer's own logprobs before the step
(`logprobs.detach()`); the ratio is 1 in value and carries the gradient.
To add a loss: write a function with this signature, register it in LOSSES and add its name to
forge.schema.LOSS_NAMES (a config is checked against the names, without importing torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from forge.schema import PREFERENCE_LOSSES, SCORE_LOSS_NAMES, LossConfig
from forge.types import Batch


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(r - l) - (r - l) - 1 >= 0; 0 where `mask`
    is 0. Masked before the exp: a token no loss trains (a prompt's) may drift from the
    reference without bound, and its exp's inf times a 0 mask would be NaN, gradients too."""
    d = ref_logprobs - logprobs
    if mask is not None:
        d = torch.where(mask.bool(), d, 0.0)
    return torch.exp(d) - d - 1


def _ratio(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp(logprobs - logprobs.detach())


def _clipped_pg(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    return -torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv)


def _per_doc(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Sum of `x` over each episode's loss tokens, [episodes]; made on `x`'s device (one zero
    for a shard of empty rows, which packing can leave)."""
    docs = batch.doc_ids.clamp(min=0).flatten()
    return x.new_zeros(max(batch.num_episodes, 1)).index_add(0, docs, (x * batch.loss_mask).flatten())


def _episode_shares(counts: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each sample's share of its episode, [episodes]: 1 for a sample with loss tokens that is
    its whole episode, its part of the loss tokens for one of an episode's several samples
    (Batch.episode_tokens), 0 without loss tokens."""
    if batch.episode_tokens is None:
        return (counts > 0).to(counts.dtype)
    return counts / batch.episode_tokens.to(counts.device, counts.dtype).clamp(min=1)


def _doc_mean(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean over each episode's loss tokens, then over episodes (an episode recorded as several
    samples is one: each sample's tokens over the whole episode's)."""
    counts = _per_doc(torch.ones_like(x), batch)
    shares = _episode_shares(counts, batch)
    return (_per_doc(x, batch) / counts.clamp(min=1) * shares).sum() / shares.sum().clamp(min=1e-6)


def _token_mean(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    return (x * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)


def _with_kl(pg: torch.Tensor, logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    if cfg.kl_coef == 0:
        return pg
    if batch.ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs reference logprobs in the batch")
    return pg + cfg.kl_coef * k3_kl(logprobs, batch.ref_logprobs, batch.loss_mask)


def grpo(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """GRPO: clipped ratio x advantage (+ k3 KL), mean per sequence, then over sequences."""
    pg = is_weight * _clipped_pg(_ratio(logprobs), batch.advantages, cfg)
    return _doc_mean(_with_kl(pg, logprobs, batch, cfg), batch)


def dr_grpo(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Dr.GRPO: like GRPO but summed over tokens and divided by a constant (no length bias)."""
    pg = _with_kl(is_weight * _clipped_pg(_ratio(logprobs), batch.advantages, cfg), logprobs, batch, cfg)
    norm = cfg.norm_tokens or batch.loss_mask.shape[1]
    return (pg * batch.loss_mask).sum() / (loss_units("dr_grpo", batch).clamp(min=1e-6) * norm)


def dapo(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """DAPO: token-level mean over the whole batch (clip-higher via clip_high; dynamic
    sampling drops zero-variance groups before the batch is built)."""
    pg = is_weight * _clipped_pg(_ratio(logprobs), batch.advantages, cfg)
    return _token_mean(_with_kl(pg, logprobs, batch, cfg), batch)


def gspo(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """GSPO: one length-normalized sequence ratio per episode, clipped at sequence level."""
    counts = _per_doc(torch.ones_like(logprobs), batch)
    # A token a masking correction dropped (weight 0) is not in its sequence's ratio; an episode
    # with none left trains on nothing (and still counts, as a dropped episode does in GRPO).
    kept = (is_weight > 0).to(logprobs.dtype)
    n_kept = _per_doc(kept, batch)
    # log of the sequence IS weight joins the ratio: s = (pi/pi_old)^(1/|y|) * w_seq
    log_w = torch.log(is_weight.clamp(min=1e-8)).detach()
    log_s = _per_doc((logprobs - logprobs.detach() + log_w) * kept, batch) / n_kept.clamp(min=1)
    adv = _per_doc(batch.advantages, batch) / counts.clamp(min=1)
    # An episode recorded as several samples: each sample's own sequence ratio, weighed by its
    # share of the episode (its ratio over the whole episode would need every sample in one pass).
    shares = _episode_shares(counts, batch)
    seq = (_clipped_pg(torch.exp(log_s), adv, cfg) * (n_kept > 0) * shares).sum() / shares.sum().clamp(min=1e-6)
    if cfg.kl_coef:
        seq = seq + cfg.kl_coef * _doc_mean(k3_kl(logprobs, batch.ref_logprobs, batch.loss_mask), batch)
    return seq


def cispo(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """CISPO: REINFORCE weighted by the clipped, detached IS ratio; every token keeps a gradient."""
    weight = is_weight.clamp(max=1 + cfg.clip_high).detach()
    pg = -weight * batch.advantages * logprobs
    return _token_mean(_with_kl(pg, logprobs, batch, cfg), batch)


def reinforce(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Plain REINFORCE with the IS correction: -w * A * log pi, token mean."""
    return _token_mean(_with_kl(-is_weight * batch.advantages * logprobs, logprobs, batch, cfg), batch)


def sft(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Supervised fine-tuning: the negative log-likelihood of the loss tokens, token mean."""
    return -_token_mean(logprobs, batch)


def _pair_log_ratios(logprobs: torch.Tensor, batch: Batch, mean: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's chosen and rejected log(pi / pi_ref), summed over its completion tokens (or
    their mean), [pairs] each. A preference batch holds pair k as episodes 2k (chosen) and 2k+1
    (rejected), in one row (collate's `keep_together=2`), so every split of rows keeps pairs whole."""
    if batch.ref_logprobs is None:
        raise ValueError("a preference loss needs the reference's logprobs in the batch")
    ratio = _per_doc(logprobs - batch.ref_logprobs, batch)
    if mean:
        ratio = ratio / _per_doc(torch.ones_like(logprobs), batch).clamp(min=1)
    pairs = batch.num_episodes // 2
    return ratio[0 : 2 * pairs : 2], ratio[1 : 2 * pairs : 2]


def _chosen_nll(logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """`rpo_alpha` x each chosen completion's per-token negative log-likelihood, summed over
    pairs (RPO, TRL's `rpo_alpha`): it keeps the chosen answers likely while the margin grows."""
    if not cfg.rpo_alpha:
        return logprobs.new_zeros(())
    pairs = batch.num_episodes // 2
    nll = -_per_doc(logprobs, batch) / _per_doc(torch.ones_like(logprobs), batch).clamp(min=1)
    return cfg.rpo_alpha * nll[0 : 2 * pairs : 2].sum()


def dpo(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """DPO: -log sigmoid(beta x (chosen's log-ratio - rejected's)) (+ RPO's NLL), mean over pairs."""
    chosen, rejected = _pair_log_ratios(logprobs, batch)
    loss = -F.logsigmoid(cfg.beta * (chosen - rejected)).sum() + _chosen_nll(logprobs, batch, cfg)
    return loss / max(len(chosen), 1)


def ipo(logprobs: torch.Tensor, batch: Batch, is_weight: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """IPO: (margin - 1 / (2 beta))^2 of the per-token mean log-ratios (as TRL) (+ RPO's NLL),
    mean over pairs; a squared loss that stops pushing once the margin is reached."""
    chosen, rejected = _pair_log_ratios(logprobs, batch, mean=True)
    loss = ((chosen - rejected - 1 / (2 * cfg.beta)) ** 2).sum() + _chosen_nll(logprobs, batch, cfg)
    return loss / max(len(chosen), 1)


def preference_metric_sums(logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """The implicit rewards beta x log(pi / pi_ref) of a preference batch, summed over its
    pairs (the trainer divides by all ranks' pairs): chosen, rejected, their margin, and how
    often the chosen's is larger (`accuracy`). The log-ratios are the ones the loss trains:
    IPO's per-token means (as TRL's IPO metrics), DPO's sums."""
    ratios = _pair_log_ratios(logprobs, batch, mean=cfg.name == "ipo")
    chosen, rejected = (cfg.beta * r.detach() for r in ratios)
    return _pair_sums(chosen, rejected)


def _pair_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
        "rewards/margin": (chosen - rejected).sum(),
        "rewards/accuracy": (chosen > rejected).to(chosen.dtype).sum(),
    }


def sequence_scores(scores: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each episode's score, its last token's (as HF's sequence classifiers read theirs), [episodes]."""
    docs = batch.doc_ids
    after = torch.cat([docs[:, 1:], docs.new_full((docs.shape[0], 1), -1)], dim=1)
    last = (docs >= 0) & (docs != after)
    return scores.new_zeros(max(batch.num_episodes, 1)).index_add(0, docs[last], scores[last])


def bradley_terry(scores: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """A reward model's loss on pairs (episodes 2k chosen, 2k+1 rejected, as the preference
    losses'): -log sigmoid(score_chosen - score_rejected), mean over pairs."""
    s = sequence_scores(scores, batch)
    pairs = batch.num_episodes // 2
    return -F.logsigmoid(s[0 : 2 * pairs : 2] - s[1 : 2 * pairs : 2]).sum() / max(pairs, 1)


def score_metric_sums(scores: torch.Tensor, batch: Batch, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """A score-head batch's pair metrics, summed over its pairs (as `preference_metric_sums`)."""
    s = sequence_scores(scores.detach(), batch)
    pairs = batch.num_episodes // 2
    return _pair_sums(s[0 : 2 * pairs : 2], s[1 : 2 * pairs : 2])


def _clipped_values(values: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    if batch.values is None or batch.returns is None:
        raise ValueError("the value loss needs the batch's values and returns (forge.losses.advantages.gae)")
    return batch.values + (values - batch.values).clamp(-cfg.value_clip, cfg.value_clip)


def value(values: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """A critic's clipped value loss (PPO's): 0.5 x max((V - R)^2, (V_clip - R)^2), token mean
    over the loss tokens, where R are the batch's returns and V_clip the batch's values moved
    toward V by at most `value_clip` (a step cannot chase a noisy return far)."""
    clipped = _clipped_values(values, batch, cfg)
    error = torch.maximum((values - batch.returns) ** 2, (clipped - batch.returns) ** 2)
    return 0.5 * _token_mean(error, batch)


def value_metric_sums(values: torch.Tensor, batch: Batch, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """A critic step's values and how many were clipped, summed over its loss tokens."""
    values = values.detach()
    clipped = (_clipped_values(values, batch, cfg) != values).to(values.dtype)
    return {"value_mean": (values * batch.loss_mask).sum(), "value_clip_frac": (clipped * batch.loss_mask).sum()}


ScoreFn = Callable[[torch.Tensor, Batch, LossConfig], torch.Tensor]
# A score head's losses and their metric sums, of its outputs: a sequence's score at every
# token (bradley_terry), or a value per token, aligned as logprobs (value).
SCORE_LOSSES: dict[str, tuple[ScoreFn, Callable[..., dict[str, torch.Tensor]]]] = {
    "bradley_terry": (bradley_terry, score_metric_sums),
    "value": (value, value_metric_sums),
}


LossFn = Callable[[torch.Tensor, Batch, torch.Tensor, LossConfig], torch.Tensor]
LOSSES: dict[str, LossFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "dapo": dapo,
    "gspo": gspo,
    "cispo": cispo,
    "reinforce": reinforce,
    "sft": sft,
    "dpo": dpo,
    "ipo": ipo,
}
TOKEN_MEANS = {"dapo", "cispo", "reinforce", "sft", "value"}  # the rest average over episodes (pairs)


def loss_units(name: str, batch: Batch) -> torch.Tensor:
    """How many of what loss `name` averages over `batch` holds: loss tokens, or episodes (with
    loss tokens; all of them for Dr.GRPO; an episode recorded as several samples once, each
    sample its share of it). The trainer weighs each micro-batch's loss by its
    share of the step's units, so a step is the whole batch's mean however the rows are split
    over ranks, micro-batches and packed rows."""
    if name in TOKEN_MEANS:
        return batch.loss_mask.sum()
    if name == "dr_grpo" and batch.episode_tokens is None:
        return batch.loss_mask.new_tensor(float(batch.num_episodes))
    if name in PREFERENCE_LOSSES or name in SCORE_LOSS_NAMES:
        return batch.loss_mask.new_tensor(float(batch.num_episodes // 2))
    # episodes with loss tokens; one recorded as several samples counts once over them
    return _episode_shares(_per_doc(torch.ones_like(batch.loss_mask), batch), batch).sum()


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r} (config key 'loss.name'); known: {', '.join(LOSSES)}")
    return LOSSES[name]


def _log_ratio(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """log(pi_trainer / pi_generator) of each loss token, detached (0 elsewhere)."""
    return (logprobs.detach() - batch.gen_logprobs) * batch.loss_mask


def _on_tokens(per_doc: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each episode's value on its tokens (padding gets episode 0's; the loss mask hides it)."""
    return per_doc[batch.doc_ids.clamp(min=0)]


def token_truncate(logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """Truncated IS per token: min(pi_trainer / pi_generator, cap)."""
    return torch.exp(_log_ratio(logprobs, batch)).clamp(max=cfg.is_cap)


def sequence_truncate(logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """Truncated IS per sequence: the product of the episode's token ratios, capped, on each of
    its tokens (unbiased at the sequence level, where the reward is)."""
    log_seq = _per_doc(_log_ratio(logprobs, batch), batch).clamp(max=math.log(cfg.is_cap))
    return _on_tokens(torch.exp(log_seq), batch)


def _in_band(log_r: torch.Tensor, cap: float) -> torch.Tensor:
    return (log_r.abs() <= math.log(cap)).to(log_r.dtype)


def token_mask(logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """Masked IS per token: the ratio where it lies in [1/cap, cap], 0 (token dropped) outside."""
    log_r = _log_ratio(logprobs, batch)
    return torch.exp(log_r) * _in_band(log_r, cfg.is_cap)


def sequence_mask(logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """Masked IS per sequence: the episode's ratio (product over its tokens) where it lies in
    [1/cap, cap], else the whole episode is dropped (weight 0)."""
    log_seq = _per_doc(_log_ratio(logprobs, batch), batch)
    return _on_tokens(torch.exp(log_seq.clamp(max=math.log(cfg.is_cap))) * _in_band(log_seq, cfg.is_cap), batch)


ISCorrection = Callable[[torch.Tensor, Batch, LossConfig], torch.Tensor]
IS_CORRECTIONS: dict[str, ISCorrection] = {
    "token_truncate": token_truncate,
    "sequence_truncate": sequence_truncate,
    "token_mask": token_mask,
    "sequence_mask": sequence_mask,
}


def importance_weight(logprobs: torch.Tensor, batch: Batch, cfg: LossConfig) -> torch.Tensor:
    """The detached IS weight of each token, by `cfg.is_correction`."""
    return IS_CORRECTIONS[cfg.is_correction](logprobs, batch, cfg).detach()


def mismatch_sums(logprobs: torch.Tensor, batch: Batch, fresh: torch.Tensor, cap: float) -> torch.Tensor:
    """Train/inference mismatch over the `fresh` tokens (1 where the generator sampled on the
    weights the trainer holds, so only numerics differ), as sums over ranks and micro-batches:
    [k3 KL(generator || trainer), |delta logprob|, tokens whose ratio is outside [1/cap, cap],
    tokens], then the largest |delta logprob| (to reduce with max)."""
    fresh = fresh.double()  # fp32's exp(d) - d - 1 is 0 for the |d| ~ 1e-7 of fp32 numerics
    d = (logprobs.detach().double() - batch.gen_logprobs.double()) * fresh
    k3 = k3_kl(torch.zeros_like(d), d) * fresh
    outside = (1 - _in_band(d, cap)) * fresh
    peak = torch.cat([d.abs().flatten(), d.new_zeros(1)]).max()  # a shard's empty micro-batch has no tokens
    return torch.stack([k3.sum(), d.abs().sum(), outside.sum(), fresh.sum(), peak])


def mismatch_metrics(kl: float, abs_sum: float, outside: float, tokens: float, peak: float) -> dict[str, float]:
    """The reduced `mismatch_sums` as means over their tokens (all 0 when there are none)."""
    n = max(tokens, 1.0)
    return {
        "kl": kl / n,
        "abs_logprob_mean": abs_sum / n,
        "abs_logprob_max": peak,
        "outside_cap_frac": outside / n,
        "tokens": tokens,
    }
