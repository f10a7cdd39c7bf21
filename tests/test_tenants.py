"""Several LoRA tenants on one trainer (a Tinker client each), and Tinker's losses."""

import pytest
import torch

from forge.losses.tinker import TINKER_LOSSES, Datums, loss_config
from forge.schema import ALL_LINEAR, LoRAConfig
from services.schema import TrainerConfig
from services.tenants import modules_of
from services.trainer import Trainer

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def datums(seed: int, rows: int = 3, width: int = 10) -> Datums:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (rows, width), generator=g)
    mask = torch.ones(rows, width)
    mask[-1, width // 2 :] = 0  # a shorter datum: padding after it
    ids = ids * mask.long()
    targets = torch.roll(ids, -1, dims=1) * mask.long()
    return Datums(ids, targets, mask, {"weights": mask.clone()})


def test_tinker_losses_are_sums_as_tinker_defines_them():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    d = Datums(
        torch.zeros(1, 3, dtype=torch.long),
        torch.zeros(1, 3, dtype=torch.long),
        torch.tensor([[1.0, 1.0, 0.0]]),  # the last position is padding
        {"weights": torch.tensor([[0.0, 1.0, 0.0]]), "logprobs": torch.tensor([[-1.0, -1.0, -9.0]])},
    )
    assert TINKER_LOSSES["cross_entropy"](lp, d, {}).item() == pytest.approx(2.0)
    d.inputs["advantages"] = torch.tensor([[1.0, -1.0, 5.0]])
    ratio = torch.exp(torch.tensor([0.0, -1.0]))
    assert TINKER_LOSSES["importance_sampling"](lp, d, {}).item() == pytest.approx(-(ratio[0] - ratio[1]).item())
    cfg = loss_config("ppo", {"clip_low_threshold": 0.9})
    # token 2: ratio e^-1 ~ 0.37 < 0.9 with a negative advantage: min(-0.37, -0.9) = -0.9
    assert TINKER_LOSSES["ppo"](lp, d, cfg).item() == pytest.approx(-(1.0 - 0.9))
    loss = TINKER_LOSSES["cispo"](lp, d, loss_config("cispo", {}))
    loss.backward()
    # cispo: every token keeps a gradient, -clip(ratio) * advantage (detached weights)
    assert lp.grad.tolist()[0] == pytest.approx([-1.0, 0.8, 0.0])
    with pytest.raises(ValueError, match="takes no key"):
        loss_config("cross_entropy", {"clip_low_threshold": 0.5})
    with pytest.raises(ValueError, match="unknown loss 'dro'"):
        loss_config("dro", {})


@pytest.fixture(scope="module")
def trainer(loop, tiny_model_dir):
    lora = LoRAConfig(rank=16, alpha=32, targets=[*ALL_LINEAR, "lm_head"])
    t = loop.run_until_complete(Trainer.options().as_service(str(tiny_model_dir), TrainerConfig(lora=lora)))
    yield t
    loop.run_until_complete(t.shutdown())


def test_tenants_stay_apart_and_a_pass_split_in_pieces_is_the_same_step(loop, trainer):
    """Tenant a's steps interleaved with b's give a the adapter a fresh twin gets alone; cutting a
    request into passes (tokens_per_pass) changes nothing; a rank-4 adapter on attention alone
    is exactly that: 4 rows of A, 4 columns of B, attention's modules."""

    async def steps(name: str, tokens_per_pass: int = 8192, n: int = 2) -> None:
        for i in range(n):
            await trainer.forward_backward.route(name, datums(i), "cross_entropy", {}, True, tokens_per_pass)
            await trainer.optim_step.route(name, ADAM)

    async def logprobs(name: str) -> list[list[float]]:
        return (await trainer.forward_backward.route(name, datums(9), "cross_entropy", {}, False))[0]

    async def main():
        every = modules_of(True, True, True)
        for name in ("a", "twin", "pieces"):
            await trainer.add_tenant.route(name, 8, 32.0, every, 0)
        await trainer.add_tenant.route("b", 4, 32.0, modules_of(False, True, False), 1)
        fresh = await logprobs("a")
        for i in range(2):  # a and b take turns on the one model
            for name in ("a", "b"):
                await trainer.forward_backward.route(name, datums(i), "cross_entropy", {}, True)
                await trainer.optim_step.route(name, ADAM)
        await steps("twin")
        await steps("pieces", tokens_per_pass=10)  # one row a pass
        a, twin, pieces = await logprobs("a"), await logprobs("twin"), await logprobs("pieces")
        assert a == twin  # the swap is a copy: bit for bit
        assert torch.allclose(torch.tensor(pieces[0]), torch.tensor(a[0]), atol=1e-5)
        assert a != fresh and [len(r) for r in a] == [10, 10, 5]
        tensors, lora = await trainer.tenant_adapter.route("b")
        assert lora.rank == 4 and lora.targets == ["k_proj", "o_proj", "q_proj", "v_proj"]
        a_shapes = {k: v.shape for k, v in tensors.items() if ".lora_A." in k}
        assert a_shapes and all(s[0] == 4 for s in a_shapes.values())
        assert any(v.abs().sum() > 0 for k, v in tensors.items() if ".lora_B." in k)  # it trained
        await trainer.remove_tenant.route("b")
        with pytest.raises(KeyError, match="no tenant 'b'"):
            await logprobs("b")

    loop.run_until_complete(main())


def test_a_tenant_trains_only_its_rank_and_modules(loop, trainer, tmp_path):
    """The rest of the largest-rank adapters stays exactly 0 through AdamW steps (weight decay too):
    the checkpoint holds the model's whole adapters."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    async def main():
        await trainer.add_tenant.route("narrow", 2, 32.0, modules_of(True, False, False), 5)
        for i in range(2):
            await trainer.forward_backward.route("narrow", datums(i), "cross_entropy", {}, True)
            await trainer.optim_step.route("narrow", {**ADAM, "weight_decay": 0.1})
        await trainer.save_tenant.route("narrow", str(tmp_path / "ck"))
        await trainer.remove_tenant.route("narrow")

    loop.run_until_complete(main())
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "ck.pt")
    adapters = torch.load(tmp_path / "ck.pt", weights_only=False)["model"]
    mlp = [k for k in adapters if ".feed_forward." in k]
    assert mlp and len(mlp) < len(adapters)
    for name, t in adapters.items():
        used = t[:2] if ".lora_a." in name else t[:, :2]
        rest = t[2:] if ".lora_a." in name else t[:, 2:]
        assert not rest.any(), name  # beyond rank 2: zeros
        assert used.any() == (name in mlp), name  # attention and the head: zeros; the MLP: trained


async def _logprobs(trainer, name):
    return (await trainer.forward_backward.route(name, datums(9), "cross_entropy", {}, False))[0]


def test_a_save_before_the_first_step_changes_no_training_and_loads_elsewhere(loop, trainer, tmp_path):
    """save_state is a read: a tenant saved before its first optim_step (after a forward_backward,
    as Tinker allows) trains as its never-saved twin, and a new tenant loads that checkpoint with
    its optimizer; a checkpoint that cannot load fails its own request, never the other tenants."""
    every = modules_of(True, True, True)

    async def main():
        for name, seed in (("pre_saved", 0), ("pre_twin", 0), ("pre_other", 1)):
            await trainer.add_tenant.route(name, 8, 32.0, every, seed)
        await trainer.forward_backward.route("pre_other", datums(0), "cross_entropy", {}, True)
        await trainer.optim_step.route("pre_other", ADAM)
        other = await _logprobs(trainer, "pre_other")
        for name in ("pre_saved", "pre_twin"):
            await trainer.forward_backward.route(name, datums(0), "cross_entropy", {}, True)
        await trainer.save_tenant.route("pre_saved", str(tmp_path / "s0"))
        await trainer.add_tenant.route("pre_loaded", 8, 32.0, every, 5)
        await trainer.load_tenant.route("pre_loaded", str(tmp_path / "s0"), True)
        await trainer.forward_backward.route("pre_loaded", datums(0), "cross_entropy", {}, True)
        for name in ("pre_saved", "pre_twin", "pre_loaded"):
            await trainer.optim_step.route(name, ADAM)
        after = [await _logprobs(trainer, name) for name in ("pre_saved", "pre_twin", "pre_loaded")]
        assert after[0] == after[1] == after[2]
        (tmp_path / "s0" / "__0_0.distcp").write_bytes(b"not a checkpoint")
        with pytest.raises(ValueError, match="checkpoint s0: cannot load it"):
            await trainer.load_tenant.route("pre_loaded", str(tmp_path / "s0"), True)
        assert await _logprobs(trainer, "pre_other") == other
        for name in ("pre_saved", "pre_twin", "pre_loaded", "pre_other"):
            await trainer.remove_tenant.route(name)

    loop.run_until_complete(main())
