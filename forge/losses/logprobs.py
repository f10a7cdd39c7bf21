"""Token logprobs from a model's last hidden states and its output head, in memory that does
not grow with tokens x vocabulary:

    lp, entropy = head_logprobs(model.lm_head, hidden, targets, chunk=2048)

The plain computation holds every token's logits at once, and autograd keeps a copy for the
backward: with Qwen3's 151,936-token vocabulary, 16k tokens are ~10 GB per fp32 copy. Here the
head runs on `chunk` tokens at a time; each chunk's backward recomputes its logits from its
hidden states (the only thing kept), so at most one chunk's logits are
alive, forward or backward. Equal to the plain computation up to float summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Head = Callable[[torch.Tensor], torch.Tensor]


def _plain(head: Head, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """All at once, through autograd: it keeps the logits' log-softmax for the backward."""
    logits = head(hidden).float()
    lp = -F.cross_entropy(logits, targets, reduction="none")
    if not with_entropy:
        return lp, None
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1)
        return lp, -(logp.exp() * logp).sum(-1)


class _ChunkLogprobs(torch.autograd.Function):
    """One chunk: the forward keeps its hidden states only; the backward
    recomputes the logits and applies d lp / d logits = onehot(target) - softmax itself (one pass
    over the chunk's softmax, where recomputing through autograd would redo the log-softmax),
    then backpropagates them through the head. The head's parameters are inputs so that autograd
    calls the backward whenever any of them trains; their gradients land in .grad through the
    head's own backward, as activation checkpointing's do."""

    @staticmethod
    def forward(ctx, head, with_entropy, hidden, targets, *params):
        with torch.no_grad():
            # log_softmax upcasts as it reads (no fp32 copy of the logits); the values are _plain's
            logp = torch.log_softmax(head(hidden), -1, dtype=torch.float32)
            lp = logp.gather(-1, targets[:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
        ctx.head = head
        ctx.save_for_backward(hidden, targets)
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        hidden, targets = ctx.saved_tensors
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(ctx.needs_input_grad[2])
            logits = ctx.head(h)
            grad = torch.softmax(logits.detach(), -1, dtype=torch.float32).mul_(-grad_lp[:, None])
            grad.scatter_add_(-1, targets[:, None], grad_lp[:, None])
            torch.autograd.backward(logits, grad.to(logits.dtype))
        return (None, None, h.grad, None) + (None,) * (len(ctx.needs_input_grad) - 4)


def head_logprobs(
    head: Head, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[i] | hidden[i]) under `head`'s logits, shaped as `targets` (hidden:
    [*targets.shape, dim]), and optionally each distribution's entropy (no grad). `chunk`
    tokens at a time (0: all at once)."""
    flat, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if chunk <= 0 or not wanted.numel():
        # All at once; so are no tokens at all, whose empty logprobs still lead back through the
        # model (FSDP's ranks take each backward together, an empty micro-batch's too).
        lp, ent = _plain(head, flat, wanted, with_entropy)
        return lp.view(targets.shape), (ent.view(targets.shape) if with_entropy else None)
    params = [p for p in head.parameters() if p.requires_grad] if isinstance(head, torch.nn.Module) else []
    lps, ents = [], []
    for start in range(0, wanted.numel(), chunk):
        lp, ent = _ChunkLogprobs.apply(
            head, with_entropy, flat[start : start + chunk], wanted[start : start + chunk], *params
        )
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps).view(targets.shape), (torch.cat(ents).view(targets.shape) if with_entropy else None)
