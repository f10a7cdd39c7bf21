"""Token logprobs from a model's last hidden states and its output head, in memory that does
not grow with tokens x vocabulary:

    lp, entropy = head_logprobs(model.lm_head, hidden, targets, chunk=2048)

The plain computation holds every token's logits at once, and autograd keeps a copy for the
backward: with Qwen3's 151,936-token vocabulary, 16k tokens are ~10 GB per fp32 copy. Here the
head runs on `chunk` tokens at a time, and the backward recomputes each chunk's logits from
the hidden states (all that is kept), so at most one chunk's logits are alive, forward or
backward. Equal to the plain computation up to float summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule


def _plain(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    temperatures: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """All at once, through autograd: it keeps the logits' log-softmax for the backward."""
    logits = _tempered(head(hidden), temperatures)
    lp = -F.cross_entropy(logits, targets, reduction="none")
    if not with_entropy:
        return lp, None
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1)
        return lp, -(logp.exp() * logp).sum(-1)


def _tempered(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits, each row divided by its token's sampling temperature (where there are any)."""
    return logits.float() if temperatures is None else logits.float() / temperatures[:, None]


class _ChunkedLogprobs(torch.autograd.Function):
    """All tokens, `chunk` at a time, as one function of the hidden states and the head's weight
    (and bias): the forward keeps only its inputs; the backward recomputes each chunk's logits
    and applies d lp / d logits = onehot(target) - softmax itself (one pass over the chunk's
    softmax, where recomputing through autograd would redo the log-softmax), then the head's
    matmuls. One op whatever the number of chunks: FSDP's ranks, whose token counts differ,
    see the same backward."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, chunk, with_entropy, temperatures):
        lps, ents = [hidden.new_zeros(0, dtype=torch.float32)], [hidden.new_zeros(0, dtype=torch.float32)]
        for start in range(0, targets.numel(), chunk):
            logits = F.linear(hidden[start : start + chunk], weight, bias)
            if temperatures is not None:
                logits = _tempered(logits, temperatures[start : start + chunk])
            # log_softmax upcasts as it reads (no fp32 copy of the logits); the values are _plain's
            logp = torch.log_softmax(logits, -1, dtype=torch.float32)
            lps.append(logp.gather(-1, targets[start : start + chunk, None])[:, 0])
            if with_entropy:
                ents.append(-(logp.exp() * logp).sum(-1))
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, targets, weight, bias, temperatures)
        ent = torch.cat(ents) if with_entropy else None
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return torch.cat(lps), ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        hidden, targets, weight, bias, temperatures = ctx.saved_tensors
        want_hidden, _, want_weight, want_bias = ctx.needs_input_grad[:4]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        for start in range(0, targets.numel(), ctx.chunk):
            h, g_lp = hidden[start : start + ctx.chunk], grad_lp[start : start + ctx.chunk, None]
            logits = F.linear(h, weight, bias)
            dtype, temps = logits.dtype, None
            if temperatures is not None:  # d lp / d logits is the tempered one's over the temperature
                temps = temperatures[start : start + ctx.chunk, None]
                logits = _tempered(logits, temps[:, 0])
            grad = torch.softmax(logits, -1, dtype=torch.float32).mul_(-g_lp)
            grad = grad.scatter_add_(-1, targets[start : start + ctx.chunk, None], g_lp)
            grad = (grad if temps is None else grad.div_(temps)).to(dtype)
            del logits
            if want_hidden:
                grad_hidden[start : start + ctx.chunk] = grad @ weight
            if want_weight:
                grad_weight += grad.T @ h
            if want_bias:
                grad_bias += grad.sum(0)
        return (
            grad_hidden,
            None,
            grad_weight.to(weight.dtype) if want_weight else None,
            grad_bias.to(bias.dtype) if want_bias else None,
            None,
            None,
            None,
        )


def chunkable(head: torch.nn.Module) -> bool:
    """Whether the chunked op can stand in for `head`: a head whose logits are F.linear of its
    weight and bias alone, sharded by FSDP or not. Any other (a LoRA head, a Tinker tenant's
    `train_unembed`; a module with hooks of its own) runs as its model runs it, all at once: the
    tokens its callers pass at once bound it (the Tinker trainer's `tokens_per_pass`)."""
    plain = isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
    return plain and (isinstance(head, FSDPModule) or not (head._forward_hooks or head._forward_pre_hooks))


def _chunked(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    with_entropy: bool,
    temperatures: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked op called as `head`'s forward, so that FSDP's hooks around it gather its
    sharded weight and reduce that weight's gradient, as for the head's own forward."""

    def forward(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _ChunkedLogprobs.apply(h, t, head.weight, head.bias, chunk, with_entropy, temperatures)

    head.forward = forward
    try:
        return head(hidden, targets)
    finally:
        del head.forward


def head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = 0,
    with_entropy: bool = False,
    temperatures: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[i] | hidden[i]) under the logits of the linear `head`, shaped as `targets`
    (hidden: [*targets.shape, dim]), and optionally each distribution's entropy (no grad).
    With `temperatures` (shaped as `targets`), each distribution is the logits over its
    token's sampling temperature, as the generator sampled it and recorded its logprob.
    `chunk` tokens at a time (0: all at once; so is a head that is not `chunkable`)."""
    flat, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    temps = temperatures.reshape(-1).float() if temperatures is not None else None
    if chunk > 0 and chunkable(head):
        lp, ent = _chunked(head, flat, wanted, chunk, with_entropy, temps)
    else:
        lp, ent = _plain(head, flat, wanted, with_entropy, temps)
    return lp.view(targets.shape), (ent.view(targets.shape) if with_entropy else None)
