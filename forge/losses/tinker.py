"""The Tinker API's losses, as Tinker defines them: sums over tokens, not means.

    loss = TINKER_LOSSES[name](target_logprobs, datums, config)   # one scalar tensor

A datum is a token sequence (`input_ids`) and, at each position t, the token the model should
predict there (`target_tokens`, usually input t + 1) with the loss's other inputs at t
(`weights` for cross_entropy; `logprobs`, the sampler's, and `advantages` for the policy
gradients). `target_logprobs` is log p(target t | inputs <= t) with grad. Every loss is a
function of those tensors alone, and its value is the `loss:sum` metric the SDK reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

# loss -> (its required loss_fn_inputs besides target_tokens, its loss_fn_config keys with defaults)
LOSS_INPUTS: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
}


@dataclass
class Datums:
    """Tinker's training examples as padded [rows, seq] tensors: row i is datum i, its positions
    first (`mask` 1 there, 0 on padding, where every input is 0)."""

    input_ids: torch.Tensor  # long
    target_tokens: torch.Tensor  # long
    mask: torch.Tensor  # float
    inputs: dict[str, torch.Tensor]  # float: the loss's other loss_fn_inputs by name

    @property
    def lengths(self) -> list[int]:
        return self.mask.sum(dim=1).long().tolist()

    def to(self, device: torch.device | str) -> Datums:
        return Datums(
            **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "inputs"},
            inputs={k: v.to(device) for k, v in self.inputs.items()},
        )

    def rows(self, rows: slice) -> Datums:
        return Datums(
            self.input_ids[rows],
            self.target_tokens[rows],
            self.mask[rows],
            {k: v[rows] for k, v in self.inputs.items()},
        )


def loss_config(name: str, given: dict[str, Any] | None) -> dict[str, float]:
    """`given` (a request's loss_fn_config) over the loss's defaults; a key the loss does not
    take, or a value that is not a number, is a ValueError naming it."""
    if name not in LOSS_INPUTS:
        raise ValueError(f"loss_fn: unknown loss {name!r}; forge serves {', '.join(LOSS_INPUTS)}")
    defaults = LOSS_INPUTS[name][1]
    unknown = sorted(set(given or {}) - set(defaults))
    if unknown:
        takes = ", ".join(defaults) or "none"
        raise ValueError(f"loss_fn_config: {name} takes no key(s) {unknown} (it takes: {takes})")
    out = dict(defaults)
    for key, value in (given or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"loss_fn_config: {key} must be a number, got {value!r}")
        out[key] = float(value)
    return out


def _ratio(lp: torch.Tensor, d: Datums) -> torch.Tensor:
    return torch.exp(lp - d.inputs["logprobs"]) * d.mask


def cross_entropy(lp: torch.Tensor, d: Datums, cfg: dict[str, float]) -> torch.Tensor:
    """Sum of the weighted token log-losses."""
    return -(lp * d.inputs["weights"] * d.mask).sum()


def importance_sampling(lp: torch.Tensor, d: Datums, cfg: dict[str, float]) -> torch.Tensor:
    """REINFORCE with the ratio of the learner's probability to the sampler's."""
    return -(_ratio(lp, d) * d.inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, d: Datums, cfg: dict[str, float]) -> torch.Tensor:
    """The clipped surrogate, token by token."""
    ratio, adv = _ratio(lp, d), d.inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(torch.minimum(ratio * adv, clipped * adv) * d.mask).sum()


def cispo(lp: torch.Tensor, d: Datums, cfg: dict[str, float]) -> torch.Tensor:
    """log p weighted by the clipped ratio, detached: every token keeps a gradient."""
    weight = _ratio(lp, d).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -(weight * lp * d.inputs["advantages"] * d.mask).sum()


TinkerLoss = Callable[[torch.Tensor, Datums, dict[str, float]], torch.Tensor]
TINKER_LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}
