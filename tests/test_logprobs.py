"""forge.losses.logprobs: the head's logprobs a chunk of tokens at a time hold at most one
chunk's logits, forward and backward, and equal the plain computation."""

import pytest
import torch

from forge.losses.logprobs import head_logprobs

VOCAB, DIM, TOKENS = 5000, 16, 600


def _case():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(DIM, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, generator=g)
    hidden = torch.randn(3, TOKENS // 3, DIM, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (3, TOKENS // 3), generator=g)
    return head, hidden, targets


def _largest_saved(chunk: int) -> int:
    """Elements of the largest tensor autograd keeps for the backward of head_logprobs."""
    head, hidden, targets = _case()
    sizes = [0]

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = head_logprobs(head, hidden, targets, chunk)
    lp.sum().backward()  # the saved tensors are enough for it
    return max(sizes)


def test_chunks_keep_no_logits_for_the_backward():
    """All at once keeps tokens x vocab logits (3M elements); in chunks of 64 tokens only the
    weight and hidden states are kept, logits live one chunk at a time."""
    assert _largest_saved(0) >= TOKENS * VOCAB
    assert _largest_saved(64) <= VOCAB * DIM


def _peak_of_backward(chunk: int) -> int:
    """The largest tensor allocated while head_logprobs' backward runs (elements)."""
    head, hidden, targets = _case()
    lp, _ = head_logprobs(head, hidden, targets, chunk)
    sizes = [0]

    class Largest(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    with Largest():
        (lp * 2).sum().backward()
    return max(sizes)


def test_the_backward_recomputes_one_chunk_of_logits_at_a_time():
    assert _peak_of_backward(0) >= TOKENS * VOCAB
    assert _peak_of_backward(64) <= 64 * VOCAB


@pytest.mark.parametrize("chunk", [1, 64, 599, 600, 10_000])
def test_chunked_logprobs_entropy_and_gradients_equal_the_plain_ones(chunk):
    """fp32, within 1e-5 (relative where a value is over 1: the head's gradient sums a term per
    chunk, 600 of them at chunk 1, in another order than one matmul): logprobs, entropies, and
    the gradients of a loss that weighs each token differently, on the hidden states and on the head."""
    results = []
    for c in (0, chunk):
        head, hidden, targets = _case()
        lp, ent = head_logprobs(head, hidden, targets, c, with_entropy=True)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        results.append((lp.detach(), ent, hidden.grad, head.weight.grad))
    for plain, chunked in zip(*results):
        scale = max(1.0, plain.abs().max().item())
        assert plain.shape == chunked.shape and (plain - chunked).abs().max().item() <= 1e-5 * scale


def test_under_no_grad_nothing_is_recomputed_and_the_values_are_the_same():
    head, hidden, targets = _case()
    with torch.no_grad():
        lp, ent = head_logprobs(head, hidden, targets, 64, with_entropy=True)
        plain, plain_ent = head_logprobs(head, hidden, targets, 0, with_entropy=True)
    assert not lp.requires_grad and (lp - plain).abs().max().item() <= 1e-5
    assert (ent - plain_ent).abs().max().item() <= 1e-5 and (ent > 0).all()


def test_no_tokens_still_lead_back_to_the_model():
    """A micro-batch cut to one token has no targets: its empty logprobs must still carry a
    graph back through the head and hidden states (each FSDP rank takes every backward)."""
    head, hidden, targets = _case()
    lp, ent = head_logprobs(head, hidden[:, :0], targets[:, :0], 64, with_entropy=True)
    assert lp.shape == (3, 0) and ent.shape == (3, 0) and lp.requires_grad
    lp.sum().backward()
    assert head.weight.grad is not None and not head.weight.grad.any()


def test_a_head_with_adapters_runs_whole_and_keeps_them():
    """A LoRA head (Tinker's train_unembed) is more than its weight: its logprobs and its
    adapter's gradient are the module's own, whatever the chunk."""

    class Adapted(torch.nn.Linear):
        def __init__(self):
            super().__init__(DIM, VOCAB, bias=False)
            self.extra = torch.nn.Parameter(torch.zeros(VOCAB))

        def forward(self, x):
            return super().forward(x) + self.extra

    got = []
    for chunk in (0, 64):
        torch.manual_seed(0)
        head = Adapted()
        with torch.no_grad():
            head.extra.fill_(0.5).index_fill_(0, torch.arange(10), 5.0)
        _, hidden, targets = _case()
        lp, _ = head_logprobs(head, hidden, targets, chunk)
        lp.sum().backward()
        got.append((lp.detach(), head.extra.grad))
    assert torch.equal(got[0][0], got[1][0]) and got[1][1] is not None and torch.equal(got[0][1], got[1][1])
