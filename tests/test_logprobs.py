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


@pytest.mark.parametrize("chunk", [0, 64])
def test_each_tokens_distribution_is_at_its_sampling_temperature(chunk):
    """With per-token temperatures (the generator's logprobs are log_softmax(logits / T)): the
    logprobs, entropies and gradients are those of autograd through logits / T, in chunks or not."""
    temps = torch.tensor([0.7, 1.0, 1.3]).repeat_interleave(TOKENS // 3).view(3, -1)
    head, hidden, targets = _case()
    weights = torch.linspace(-1, 1, TOKENS).view(3, -1)
    lp, ent = head_logprobs(head, hidden, targets, chunk, with_entropy=True, temperatures=temps)
    (lp * weights).sum().backward()
    want_head, want_hidden, _ = _case()
    logp = torch.log_softmax(want_head(want_hidden) / temps[..., None], -1)
    want = logp.gather(-1, targets[..., None])[..., 0]
    (want * weights).sum().backward()
    assert (lp - want).abs().max().item() <= 1e-5 and (ent - -(logp.exp() * logp).sum(-1)).abs().max() <= 1e-4
    assert (hidden.grad - want_hidden.grad).abs().max().item() <= 1e-5
    scale = want_head.weight.grad.abs().max().item()
    assert (head.weight.grad - want_head.weight.grad).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert (lp - head_logprobs(head, hidden, targets, chunk)[0]).abs()[0].min() > 0  # not the plain ones


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


class _Top(torch.nn.Module):
    """A decoder's last layers as torchtitan shards them: the final norm and the head, one FSDP unit."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        return self.norm(x)


def _sharded_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    top = _Top()
    fully_shard([top.norm, top.lm_head])
    fully_shard(top)
    for m in top.modules():  # as torchtitan's decoders under gloo: the ranks' gradients summed
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    head, hidden, targets = _case()
    mine = slice(rank, rank + 1)  # each rank its own row of the three
    sizes = [0]

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = head_logprobs(top.lm_head, top(hidden[mine]), targets[mine], 64, with_entropy=True)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    grad = top.lm_head.weight.grad.full_tensor()
    gathered = [None] * world
    dist.all_gather_object(gathered, (lp.detach(), ent, hidden.grad[mine]))
    if rank == 0:
        torch.save({"largest": max(sizes), "grad": grad, "rows": gathered}, out)
    dist.destroy_process_group()


def test_an_fsdp_sharded_head_runs_in_chunks_and_reduces_its_gradient(tmp_path):
    """The trainer's head is an FSDP unit (with the final norm, as torchtitan shards it), hooks
    and all: its logprobs too are taken in chunks, nothing of tokens x vocabulary kept for the
    backward, and equal the plain ones, its gradient reduced over the ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sharded_rank, args=(2, port, str(tmp_path / "out.pt")), nprocs=2)
    got = torch.load(tmp_path / "out.pt")
    torch.manual_seed(0)
    top = _Top()
    _, hidden, targets = _case()
    lp, ent = head_logprobs(top.lm_head, top(hidden[:2]), targets[:2], 0, with_entropy=True)
    (lp * torch.linspace(-1, 1, lp[0].numel()).repeat(2, 1)).sum().backward()
    assert got["largest"] < (TOKENS // 3) * VOCAB
    assert (got["grad"] - top.lm_head.weight.grad).abs().max().item() <= 1e-5 * top.lm_head.weight.grad.abs().max()
    for r, (lp_r, ent_r, hidden_grad) in enumerate(got["rows"]):
        assert (lp_r - lp[r : r + 1]).abs().max().item() <= 1e-5 and (ent_r - ent[r : r + 1]).abs().max().item() <= 1e-5
        assert (hidden_grad - hidden.grad[r : r + 1]).abs().max().item() <= 1e-5 * max(1.0, hidden.grad.abs().max())
