"""Each loss against a value computed by hand on a two-episode batch."""

import math

import pytest
import torch

from forge.config import ConfigError
from forge.losses import IS_CORRECTIONS, LOSSES, get_loss, importance_weight, k3_kl, loss_units, mismatch_sums
from forge.losses import SCORE_LOSSES as LOSSES_BY_HEAD
from forge.losses.advantages import (
    explained_variance,
    finite_episodes,
    gae,
    group_advantages,
    teacher_advantages,
    whiten,
)
from forge.schema import IS_CORRECTION_NAMES, LOSS_NAMES, LossConfig
from forge.types import Episode, collate, continued

# Episode 1: prompt 1 token, 3 response tokens, advantage +1. Episode 2: 2 response tokens, -0.5.
EPS = [
    Episode(tokens=[1, 5, 6, 7], loss_mask=[0, 1, 1, 1], gen_logprobs=[0, -0.5, -1.0, -2.0], advantage=1.0),
    Episode(tokens=[1, 8, 9], loss_mask=[0, 1, 1], gen_logprobs=[0, -1.0, -0.2], advantage=-0.5),
]
LP = [[0.0, -0.5, -1.0, -2.0], [0.0, -1.0, -0.2, 0.0]]  # the trainer's logprobs (= generator's: on-policy)


def with_ref(batch, refs):
    """`batch` with the reference model's logprobs of each episode's tokens, where the
    Reference service puts them (after collate, in the batch's own layout)."""
    batch.ref_logprobs = torch.zeros(batch.input_ids.shape)
    for i, r in enumerate(refs):
        batch.ref_logprobs[batch.doc_ids == i] = torch.tensor(r, dtype=torch.float)
    return batch


def run(name, is_weight=None, ref=None, **cfg):
    batch = collate(EPS, pad_id=0)
    if ref:
        with_ref(batch, ref)
    lp = torch.tensor(LP, requires_grad=True)
    w = torch.ones(2, 4) if is_weight is None else torch.tensor(is_weight)
    loss = LOSSES[name](lp, batch, w, LossConfig(name=name, **cfg))
    loss.backward()
    return loss.item(), lp.grad


def test_grpo_sequence_mean():
    loss, grad = run("grpo")
    assert loss == pytest.approx((-1.0 + 0.5) / 2)  # per-token -A, mean per episode, then over episodes
    assert grad[0, 1:].tolist() == pytest.approx([-1 / 6] * 3) and grad[1, 1:3].tolist() == pytest.approx([0.125] * 2)
    assert grad[0, 0] == 0 and grad[1, 3] == 0  # prompt and padding get no gradient


def test_grpo_k3_kl():
    ref = [[0, -0.5 + 0.0, -1.0 + 0.1, -2.0 - 0.2], [0, -1.0, -0.2]]
    loss, _ = run("grpo", ref=ref, kl_coef=0.1)
    kl1 = (0 + (math.exp(0.1) - 0.1 - 1) + (math.exp(-0.2) + 0.2 - 1)) / 3
    assert loss == pytest.approx(((-1 + 0.1 * kl1) + 0.5) / 2)
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0


def test_dr_grpo_constant_normalizer():
    loss, _ = run("dr_grpo", norm_tokens=10)
    assert loss == pytest.approx((-3 * 1.0 + 2 * 0.5) / (2 * 10))


def test_dapo_token_mean():
    loss, grad = run("dapo")
    assert loss == pytest.approx((-3 * 1.0 + 2 * 0.5) / 5)
    assert grad[0, 1].item() == pytest.approx(-1 / 5)


def test_reinforce_and_cispo():
    loss, _ = run("reinforce")
    assert loss == pytest.approx((3.5 - 0.6) / 5)  # -A*lp: 1*(0.5+1+2), -0.5*(1+0.2)
    w = [[1, 1.5, 1, 1], [1, 1, 1, 1]]
    loss, _ = run("cispo", is_weight=w, clip_high=0.2)  # weight 1.5 clipped to 1.2
    assert loss == pytest.approx((1.2 * 0.5 + 1 + 2 - 0.6) / 5)


def test_gspo_sequence_ratio_clipped():
    loss, _ = run("gspo")
    assert loss == pytest.approx((-1.0 + 0.5) / 2)
    w = [[2, 2, 2, 2], [1, 1, 1, 1]]  # episode 1's sequence ratio is 2 -> clipped to 1.2
    loss, _ = run("gspo", is_weight=w)
    assert loss == pytest.approx((-1.2 + 0.5) / 2)


def test_gspo_leaves_a_masked_token_out_of_its_sequence_ratio():
    """A token a masking correction drops (weight 0) leaves GSPO's sequence ratio: the episode
    trains on its other tokens as if it were not there; an episode dropped whole trains on none."""
    loss, grad = run("gspo", is_weight=[[1, 1, 1, 0], [1, 1, 1, 1]])  # episode 1's last token dropped
    assert loss == pytest.approx((-1.0 + 0.5) / 2)
    assert grad[0, 1:3].tolist() == pytest.approx([-1 / 4] * 2) and grad[0, 3] == 0
    assert grad[1, 1:3].tolist() == pytest.approx([0.125] * 2)
    loss, grad = run("gspo", is_weight=[[0, 0, 0, 0], [1, 1, 1, 1]])  # episode 1 dropped (sequence_mask)
    assert loss == pytest.approx(0.5 / 2) and not grad[0].any()
    assert grad[1, 1:3].tolist() == pytest.approx([0.125] * 2)


def test_importance_weight_and_advantages():
    ep = Episode(tokens=[1, 2, 3], loss_mask=[0, 1, 1], gen_logprobs=[0, -2.0, -1.0])
    w = importance_weight(torch.tensor([[0, -1.0, -2.0]]), collate([ep], pad_id=0), LossConfig(is_cap=2.0))
    assert w[0, 1:].tolist() == pytest.approx([2.0, math.exp(-1)])  # e^1 truncated at 2, e^-1
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert group_advantages(r).tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert group_advantages(r, std_normalize=False).tolist() == [0.5, -0.5, -0.5, 0.5]


@pytest.mark.parametrize("reward", [0.7, 0.9, 0.3, 0.2, 1.0])
@pytest.mark.parametrize("n", [4, 8])
def test_a_group_of_equal_rewards_has_no_advantage(reward, n):
    """No signal, no push: in fp32 the group's mean of n equal rewards is not always the reward,
    and std-normalizing that rounding gave each sample the same advantage of about 0.06."""
    r = torch.tensor([reward] * n)
    assert group_advantages(r).tolist() == [0.0] * n
    assert group_advantages(r, std_normalize=False).tolist() == [0.0] * n
    near = group_advantages(torch.tensor([0.7] * (n - 1) + [0.8]))
    assert near[-1] > 0 and near[0] < 0 and near.sum().abs() < 1e-5


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_the_kl_term_ignores_tokens_no_loss_trains(name):
    """A prompt token the policy has drifted on far below the reference (exp of the difference
    overflows fp32) leaves the loss and every gradient finite, and the same as without it."""
    ref = [[0, -0.5, -0.9, -2.2], [0, -1.0, -0.2]]
    loss, grad = run(name, ref=ref, kl_coef=0.1)
    batch = with_ref(collate(EPS, pad_id=0), ref)
    batch.ref_logprobs[0, 0] = -5.0
    lp = torch.tensor(LP)
    lp[0, 0] = -100.0  # never trained: the prompt
    lp.requires_grad_(True)
    drifted = LOSSES[name](lp, batch, torch.ones(2, 4), LossConfig(name=name, kl_coef=0.1))
    drifted.backward()
    assert drifted.item() == pytest.approx(loss) and torch.isfinite(lp.grad).all()
    assert torch.allclose(lp.grad, grad)


@pytest.mark.parametrize(
    "key, value", [("clip_low", -0.5), ("clip_low", 1.0), ("clip_high", -0.5), ("kl_coef", -0.1), ("norm_tokens", -64)]
)
def test_a_loss_setting_that_would_turn_the_loss_around_is_refused(key, value):
    with pytest.raises(ConfigError, match=f"config key 'loss.{key}' must be"):
        LossConfig(**{key: value}).validate()


# Episode 1's token log-ratios (trainer - generator) are +0.5, +0.5, 0: its sequence ratio is e^1.
# Episode 2's are -1.0, +0.1: its sequence ratio is e^-0.9. The band is [1/2, 2] (log 2 = 0.69).
SHIFTED = [[0.0, 0.0, -0.5, -2.0], [0.0, -2.0, -0.1, 0.0]]


@pytest.mark.parametrize(
    "correction, want",
    [
        ("token_truncate", [[math.exp(0.5), math.exp(0.5), 1.0], [math.exp(-1.0), math.exp(0.1)]]),
        ("sequence_truncate", [[2.0] * 3, [math.exp(-0.9)] * 2]),  # e^1 capped at 2
        ("token_mask", [[math.exp(0.5), math.exp(0.5), 1.0], [0.0, math.exp(0.1)]]),  # e^-1 < 1/2: dropped
        ("sequence_mask", [[0.0] * 3, [0.0] * 2]),  # e^1 > 2 and e^-0.9 < 1/2: both episodes dropped
    ],
)
def test_is_corrections_by_hand(correction, want):
    batch = collate(EPS, pad_id=0)
    w = IS_CORRECTIONS[correction](torch.tensor(SHIFTED), batch, LossConfig(is_cap=2.0, is_correction=correction))
    got = [w[0, 1:4].tolist(), w[1, 1:3].tolist()]
    assert got[0] == pytest.approx(want[0]) and got[1] == pytest.approx(want[1])
    kept = IS_CORRECTIONS[correction](torch.tensor(SHIFTED), batch, LossConfig(is_cap=3.0, is_correction=correction))
    assert (kept[batch.loss_mask.bool()] > 0).all()  # a band of [1/3, 3] keeps every token and episode


def test_unknown_is_correction_is_named():
    with pytest.raises(ValueError, match="'loss.is_correction': 'tis'"):
        LossConfig(is_correction="tis").validate()


def test_a_config_is_checked_against_the_registered_names():
    """forge.schema checks `loss.name` and `loss.is_correction` without importing torch: by name."""
    assert list(LOSSES) == list(LOSS_NAMES) and list(IS_CORRECTIONS) == list(IS_CORRECTION_NAMES)


def test_mismatch_sums_count_only_fresh_tokens():
    batch = collate(EPS, pad_id=0)
    fresh = batch.loss_mask.clone()
    fresh[1] = 0  # episode 2 was sampled on older weights: staleness, not mismatch
    kl, abs_sum, outside, tokens, peak = mismatch_sums(torch.tensor(SHIFTED), batch, fresh, cap=1.5).tolist()
    d = [0.5, 0.5, 0.0]
    assert kl == pytest.approx(sum(math.exp(x) - x - 1 for x in d))  # k3 of KL(generator || trainer)
    assert (abs_sum, outside, tokens, peak) == pytest.approx((1.0, 2.0, 3.0, 0.5))  # e^0.5 > 1.5 twice


def test_unknown_loss_is_named():
    with pytest.raises(ValueError, match="unknown loss 'ppo2'.*'loss.name'"):
        LossConfig(name="ppo2").validate()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_runs_on_the_device_of_its_inputs(name):
    """Every tensor a loss makes follows its inputs' device: on `meta`, a tensor made on the
    default device would fail to mix, as a CPU tensor would on the first GPU step."""
    ref = [[0, -0.5, -1.0, -2.0], [0, -1.0, -0.2]]
    batch = with_ref(collate(EPS, pad_id=0), ref).to("meta")
    lp = torch.tensor(LP).to("meta").requires_grad_()
    cfg = LossConfig(name=name, kl_coef=0.1)
    loss = LOSSES[name](lp, batch, importance_weight(lp, batch, cfg), cfg)
    loss.backward()
    assert loss.device.type == "meta" and loss.shape == () and lp.grad.device.type == "meta"


@pytest.mark.parametrize("correction", sorted(IS_CORRECTIONS))
def test_is_correction_runs_on_the_device_of_its_inputs(correction):
    batch = collate(EPS, pad_id=0).to("meta")
    w = importance_weight(torch.tensor(SHIFTED).to("meta"), batch, LossConfig(is_correction=correction))
    assert w.device.type == "meta" and w.shape == batch.loss_mask.shape


def test_std_normalize_is_the_losses_choice():
    assert LossConfig(name="grpo").normalize_std and not LossConfig(name="dr_grpo").normalize_std
    assert LossConfig(name="dr_grpo", std_normalize=True).normalize_std


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_multi_turn_mask_trains_only_sampled_tokens(name):
    """A multi-turn episode: prompt, the policy's turn, a tool reply, the policy again. Every loss
    gives the prompt and the tool reply (mask 0) zero gradient, and the sampled tokens some."""
    mask = [0, 0, 1, 1, 0, 0, 0, 1, 1]
    ep = Episode(
        tokens=list(range(1, 10)),
        loss_mask=mask,
        gen_logprobs=[-1.0 * m for m in mask],
        advantage=0.7,
    )
    other = Episode(tokens=[1, 2, 3], loss_mask=[0, 1, 1], gen_logprobs=[0, -1, -1], advantage=-0.7)
    batch = with_ref(collate([ep, other], pad_id=0), [[-1.2] * 9, [-1.2] * 3])
    lp = torch.full(batch.input_ids.shape, -1.1, requires_grad=True)
    cfg = LossConfig(name=name, kl_coef=0.1)
    LOSSES[name](lp, batch, importance_weight(lp, batch, cfg), cfg).backward()
    grad = lp.grad[0]
    assert all(grad[t] == 0 for t, m in enumerate(mask) if not m)
    assert all(grad[t] != 0 for t, m in enumerate(mask) if m)


def test_teacher_advantages_are_the_mixed_teachers_reverse_kl_on_model_tokens():
    """Two teachers weighted 3:1; the second episode has an environment token (mask 0) between
    its model tokens: it and the prompts get no advantage."""
    eps = [
        Episode(tokens=[1, 5, 6], loss_mask=[0, 1, 1], gen_logprobs=[0, -0.5, -1.0]),
        Episode(tokens=[1, 8, 2, 9], loss_mask=[0, 1, 0, 1], gen_logprobs=[0, -1.0, 0, -0.2]),
    ]
    batch = collate(eps, pad_id=0)
    a = torch.tensor([[-9.0, -0.1, -0.3, 0.0], [-9.0, -2.0, -9.0, -0.2]])
    b = torch.tensor([[-9.0, -0.5, -1.0, 0.0], [-9.0, -1.0, -9.0, -1.0]])
    adv, rkl = teacher_advantages(batch, [a, b], [3.0, 1.0], coef=2.0)
    teacher = [[-0.2, -0.475], [-1.75, -0.4]]  # 0.75 a + 0.25 b on the model tokens
    expect_rkl = [
        [0, -0.5 - teacher[0][0], -1.0 - teacher[0][1], 0],
        [0, -1.0 - teacher[1][0], 0, -0.2 - teacher[1][1]],
    ]
    torch.testing.assert_close(rkl, torch.tensor(expect_rkl))
    torch.testing.assert_close(adv, -2.0 * torch.tensor(expect_rkl))
    # Per data source: `a` scores only the first episode's, nobody the second's (no signal there).
    only_first = (batch.doc_ids == 0).float() * 3.0
    adv, rkl = teacher_advantages(batch, [a, b], [only_first, torch.zeros_like(only_first)], coef=2.0)
    expect_rkl = [[0, -0.5 + 0.1, -1.0 + 0.3, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(rkl, torch.tensor(expect_rkl))
    torch.testing.assert_close(adv, -2.0 * torch.tensor(expect_rkl))


def test_a_teachers_number_where_it_does_not_count_never_reaches_the_advantages():
    """A teacher's -inf on an episode it does not score (weight 0: another data source's) and a
    NaN on a prompt token (mask 0) leave the advantages as if they were any number there; a NaN
    where a teacher scores a loss token makes that episode's advantages non-finite (the caller
    drops its group), and only that episode's."""
    eps = [
        Episode([1, 5, 6], [0, 1, 1], [0.0, -0.5, -1.0]),
        Episode([1, 8, 9], [0, 1, 1], [0.0, -1.0, -0.2]),
    ]
    batch = collate(eps, pad_id=0)
    only_first = (batch.doc_ids == 0).float()
    a = torch.tensor([[float("nan"), -0.1, -0.3], [0.0, float("-inf"), -0.5]])  # episode 0's source only
    c = torch.tensor([[float("nan"), -0.5, -1.0], [float("nan"), -1.0, -1.0]])  # every source
    adv, rkl = teacher_advantages(batch, [a, c], [only_first, torch.ones_like(only_first)], coef=1.0)
    torch.testing.assert_close(rkl, torch.tensor([[0.0, -0.5 + 0.3, -1.0 + 0.65], [0.0, 0.0, 0.8]]))
    assert adv.isfinite().all()
    c[1, 2] = float("nan")
    adv, _ = teacher_advantages(batch, [a, c], [only_first, torch.ones_like(only_first)], coef=1.0)
    assert finite_episodes(batch, adv).tolist() == [True, False] and adv[0].isfinite().all()


@pytest.mark.parametrize("weight", [1e-13, 1e-50])
def test_a_single_teacher_of_any_positive_weight_is_that_teacher(weight):
    """Weights are proportions: one teacher of a tiny weight (any above 0, as the config accepts)
    is that teacher, not a mix shrunk toward 0 nor, below float32's range, no teacher at all."""
    batch = collate([Episode([1, 5, 6], [0, 1, 1], [0.0, -0.5, -1.0])], pad_id=0)
    t = torch.tensor([[0.0, -2.0, -3.0]])
    expected, _ = teacher_advantages(batch, [t], [1.0], coef=1.0)
    for w in (weight, torch.full(batch.input_ids.shape, weight, dtype=torch.float64)):
        torch.testing.assert_close(teacher_advantages(batch, [t], [w], coef=1.0)[0], expected)


def test_teacher_weights_of_any_size_mix_in_proportion():
    """Weights are proportions at any size a config accepts (finite, > 0): one teacher of weight
    1e308 is that teacher, two of 1e308 each are their even mix; none of them overflows the mix
    into an inf or a NaN that would drop every group."""
    batch = collate([Episode([1, 5, 6], [0, 1, 1], [0.0, -0.5, -1.0])], pad_id=0)
    a, b = torch.tensor([[0.0, -2.0, -3.0]]), torch.tensor([[0.0, -1.0, -4.0]])
    one, _ = teacher_advantages(batch, [a], [1.0], coef=1.0)
    torch.testing.assert_close(teacher_advantages(batch, [a], [1e308], coef=1.0)[0], one)
    even, _ = teacher_advantages(batch, [a, b], [1.0, 1.0], coef=1.0)
    torch.testing.assert_close(teacher_advantages(batch, [a, b], [1e308, 1e308], coef=1.0)[0], even)
    torch.testing.assert_close(teacher_advantages(batch, [a, b], [1e308, 1e-300], coef=1.0)[0], one)


# A preference pair: chosen (2 completion tokens), rejected (1), one row, with the reference's logprobs.
PAIR = [
    Episode(tokens=[1, 5, 6], loss_mask=[0, 1, 1], gen_logprobs=[0.0] * 3),
    Episode(tokens=[1, 8], loss_mask=[0, 1], gen_logprobs=[0.0] * 2),
]
PAIR_LP, PAIR_REF = [[0.0, -0.5, -1.0], [0.0, -2.0]], [[0.0, -1.0, -1.0], [0.0, -1.0]]


def pair_batch(pairs=1):
    batch = collate(PAIR * pairs, pad_id=0, keep_together=2)
    lp = torch.zeros(batch.input_ids.shape)
    for i in range(2 * pairs):
        lp[batch.doc_ids == i] = torch.tensor(PAIR_LP[i % 2])
    return with_ref(batch, PAIR_REF * pairs), lp


@pytest.mark.parametrize(
    "name, rpo_alpha, expected",
    [
        ("dpo", 0.0, math.log1p(math.exp(-0.15))),
        ("ipo", 0.0, (1.25 - 5.0) ** 2),
        ("dpo", 2.0, math.log1p(math.exp(-0.15)) + 2.0 * 0.75),
    ],
)
def test_preference_losses_by_hand(name, rpo_alpha, expected):
    """log-ratios: chosen -0.5 + 0 = 0.5 (mean 0.25), rejected -1.0; beta 0.1. DPO: -log
    sigmoid(0.1 x 1.5); IPO: (1.25 - 1 / 0.2)^2 on the per-token means; RPO adds alpha x the
    chosen's per-token NLL, (0.5 + 1.0) / 2."""
    batch, lp = pair_batch()
    assert batch.input_ids.shape[0] == 1 and batch.positions[0].tolist() == [0, 1, 2, 0, 1]
    cfg = LossConfig(name=name, beta=0.1, rpo_alpha=rpo_alpha)
    loss = LOSSES[name](lp.requires_grad_(), batch, torch.ones_like(lp), cfg)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_preference_metrics_and_pairs_across_micro_batches():
    """The implicit rewards by hand; and the trainer's split of a batch into micro-batches keeps
    each pair whole: their share-weighted losses add up to the whole batch's."""
    from forge.losses import loss_units, preference_metric_sums
    from services.trainer import _rows

    batch, lp = pair_batch()
    sums = preference_metric_sums(lp, batch, LossConfig(name="dpo", beta=0.1))
    assert {k: round(v.item(), 6) for k, v in sums.items()} == {
        "rewards/chosen": 0.05,
        "rewards/rejected": -0.1,
        "rewards/margin": 0.15,
        "rewards/accuracy": 1.0,
    }
    batch, lp = pair_batch(pairs=4)
    lp[batch.doc_ids == 2] -= 1.0  # pair 1's chosen is now the less likely
    cfg = LossConfig(name="dpo", beta=0.1)
    whole = LOSSES["dpo"](lp, batch, torch.ones_like(lp), cfg)
    total = loss_units("dpo", batch)
    rows = torch.arange(batch.input_ids.shape[0])
    parts = []
    for mb_rows in (rows[:1], rows[1:]):
        mb = _rows(batch, mb_rows)
        parts.append(LOSSES["dpo"](lp[mb_rows], mb, torch.ones_like(lp[mb_rows]), cfg) * loss_units("dpo", mb) / total)
    assert total.item() == 4 and sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)


def test_ipo_metrics_are_its_own_implicit_rewards():
    """IPO's implicit rewards are beta x the per-token mean log-ratios its loss trains (TRL's
    IPO metrics): chosen 0.5 over 2 tokens (0.25), rejected -1.0 over 1. A chosen that wins on
    its sum but loses on its mean is not counted as ranked right."""
    from forge.losses import preference_metric_sums

    batch, lp = pair_batch()
    sums = preference_metric_sums(lp, batch, LossConfig(name="ipo", beta=0.1))
    assert {k: round(v.item(), 6) for k, v in sums.items()} == {
        "rewards/chosen": 0.025,
        "rewards/rejected": -0.1,
        "rewards/margin": 0.125,
        "rewards/accuracy": 1.0,
    }
    lp[batch.doc_ids == 1] += 1.4  # rejected: 0.4 (one token), above the chosen's mean, below its sum
    sums = preference_metric_sums(lp, batch, LossConfig(name="ipo", beta=0.1))
    assert sums["rewards/accuracy"].item() == 0 and sums["rewards/margin"].item() == pytest.approx(-0.015)


def test_gae_by_hand_over_tokens_turns_and_a_cut_episode():
    """Episode 0: a prompt token, then 3 of the model's tokens, reward 1 at the last. Episode 1,
    multi-turn: the model's token, 2 environment tokens (skipped: no step, no value), the model's
    2 tokens; reward 2. Episode 2 is cut short after its 2 tokens: its return goes on past them,
    bootstrapped from the value after its last token (0.5). gamma 0.9, lam 0.8."""
    eps = [
        Episode([1, 5, 6, 7], [0, 1, 1, 1], [0.0] * 4),
        Episode([1, 5, 8, 9, 6, 7], [0, 1, 0, 0, 1, 1], [0.0] * 6),
        Episode([1, 5, 6], [0, 1, 1], [0.0] * 3),
    ]
    batch = collate(eps, pad_id=0)
    values = torch.tensor(
        [[9.0, 0.5, 0.6, 0.7, 0, 0], [9.0, 1.0, 9.0, 9.0, 1.2, 1.4], [9.0, 0.3, 0.4, 0, 0, 0]]
    )  # 9: never read
    g, lam = 0.9, 0.8

    def by_hand(v, r_last, after):
        delta = [
            (r_last if i == len(v) - 1 else 0) + g * (v[i + 1] if i + 1 < len(v) else after) - v[i]
            for i in range(len(v))
        ]
        adv, running = [0.0] * len(v), 0.0
        for i in reversed(range(len(v))):
            running = delta[i] + g * lam * running
            adv[i] = running
        return adv

    adv, ret = gae(batch, values, torch.tensor([1.0, 2.0, 0.0]), g, lam, bootstrap=torch.tensor([0.0, 0.0, 0.5]))
    assert adv[0, 1:4].tolist() == pytest.approx(by_hand([0.5, 0.6, 0.7], 1.0, 0.0), abs=1e-6)
    assert adv[1, [1, 4, 5]].tolist() == pytest.approx(by_hand([1.0, 1.2, 1.4], 2.0, 0.0), abs=1e-6)
    assert adv[2, 1:3].tolist() == pytest.approx(by_hand([0.3, 0.4], 0.0, 0.5), abs=1e-6)
    # nothing on prompts, environment tokens or padding; returns are advantages + values there
    off = batch.loss_mask == 0
    assert adv[off].abs().max() == 0 and ret[off].abs().max() == 0
    assert torch.allclose(ret[~off], (adv + values)[~off])
    # lam 1, gamma 1, no bootstrap: every token's advantage is the reward minus its value
    adv1, _ = gae(batch, values, torch.tensor([1.0, 2.0, 0.0]))
    assert adv1[0, 1:4].tolist() == pytest.approx([0.5, 0.4, 0.3], abs=1e-6)
    w = whiten(adv, batch.loss_mask)
    assert w[~off].mean().item() == pytest.approx(0, abs=1e-6) and w[~off].std(unbiased=False).item() == pytest.approx(
        1, abs=1e-4
    )


def test_gae_runs_on_over_the_samples_of_one_episode():
    """A multi-turn episode recorded as two samples (the second turn re-rendered the first:
    sample B holds it again, mask 0) gets the advantages it would have whole: sample A's last
    token steps to B's first model token, and the reward comes once, at B's last; an episode
    after them is its own. gamma 0.9, lam 0.5."""
    g, lam = 0.9, 0.5
    whole = collate([Episode([1, 5, 8, 6], [0, 1, 0, 1], [0.0] * 4)], pad_id=0)
    aw, rw = gae(whole, torch.tensor([[9.0, 0.2, 9.0, 0.9]]), torch.tensor([1.0]), g, lam)
    a, b = Episode([1, 5], [0, 1], [0.0] * 2, part=("e", 0)), Episode([1, 7, 8, 6], [0, 0, 0, 1], [0.0] * 4)
    b.part = ("e", 1)
    other = Episode([1, 5, 6], [0, 1, 1], [0.0] * 3)
    split = collate([a, b, other], pad_id=0)
    values = torch.tensor([[9.0, 0.2, 0, 0], [9.0, 9.0, 9.0, 0.9], [9.0, 0.3, 0.4, 0]])
    assert continued([a, b, other]).tolist() == [True, False, False]
    adv, ret = gae(split, values, torch.tensor([1.0, 1.0, 2.0]), g, lam, continues=continued([a, b, other]))
    assert [adv[0, 1].item(), adv[1, 3].item()] == pytest.approx([aw[0, 1].item(), aw[0, 3].item()], abs=1e-6)
    assert ret[0, 1].item() == pytest.approx(rw[0, 1].item(), abs=1e-6)
    alone, _ = gae(collate([other], pad_id=0), values[2:, :3], torch.tensor([2.0]), g, lam)
    assert adv[2, :3].tolist() == pytest.approx(alone[0].tolist(), abs=1e-6)
    # Samples that are not consecutive parts of one episode are episodes of their own.
    assert continued([a, other, b]).tolist() == [False, False, False]
    assert continued([b, a]).tolist() == [False, False] and continued([]).tolist() == []


def test_gae_over_a_batch_of_many_long_episodes_is_the_recursion_by_hand():
    """128 episodes of 1024 tokens (the tokens grouped by episode in one sort, the recursion in
    Python floats): an episode's advantages are what the recursion gives by hand."""
    n, length, g, lam = 128, 1024, 0.99, 0.95
    batch = collate([Episode([1] * length, [0] + [1] * (length - 1), [0.0] * length)] * n, pad_id=0)
    values = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    rewards = torch.rand(n, generator=torch.Generator().manual_seed(1))
    adv, _ = gae(batch, values, rewards, g, lam)
    v, running, want = values[5, 1:].double().tolist(), 0.0, []
    for i in reversed(range(len(v))):
        nxt = v[i + 1] if i + 1 < len(v) else 0.0
        running = (float(rewards[5]) if i == len(v) - 1 else 0.0) + g * nxt - v[i] + g * lam * running
        want.append(running)
    assert adv[5, 1:].tolist() == pytest.approx(want[::-1], abs=1e-4)


def test_a_non_finite_value_costs_its_episode_only():
    """A critic's NaN on one episode's token: that episode's advantages are not finite (its
    group is dropped by the caller), the other's are as without it; values off the episodes'
    tokens (inf on a prompt) never reach the returns; whitening and explained variance over a
    mask read nothing outside it."""
    batch = collate([Episode([1, 5, 6], [0, 1, 1], [0.0] * 3), Episode([1, 8, 9], [0, 1, 1], [0.0] * 3)], pad_id=0)
    values = torch.tensor([[float("inf"), 0.2, 0.4], [0.0, float("nan"), 0.3]])
    adv, ret = gae(batch, values, torch.tensor([1.0, 0.0]), 1.0, 0.95)
    assert finite_episodes(batch, adv).tolist() == [True, False]
    clean, _ = gae(batch, values.nan_to_num(0.0, 0.0), torch.tensor([1.0, 0.0]), 1.0, 0.95)
    assert torch.equal(adv[0], clean[0]) and ret[0, 0] == 0 and ret[0].isfinite().all()
    first = (batch.doc_ids == 0) & (batch.loss_mask > 0)
    w = whiten(adv, first)
    assert w.isfinite().all() and w[first].tolist() == pytest.approx([1.0, -1.0], abs=1e-3)
    assert math.isfinite(explained_variance(values, ret, first))


def test_value_loss_clips_each_tokens_move_by_hand():
    """The critic's loss on episode 0's 3 tokens (returns 1): the batch held values 0.5, 0.5,
    0.5; the step's are 0.6 (inside the clip 0.2: (0.6 - 1)^2), 1.0 (moved 0.5: the clipped 0.7
    is further from the return, max((1 - 1)^2, (0.7 - 1)^2) = 0.09) and 0.0 (moved -0.5: the
    unclipped is further, (0 - 1)^2). Half the token mean; the gradient stops at a clipped token
    only where the clipped term is the larger."""
    batch = collate(EPS[:1], pad_id=0)
    batch.values = torch.tensor([[0.0, 0.5, 0.5, 0.5]])
    batch.returns = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    v = torch.tensor([[7.0, 0.6, 1.0, 0.0]], requires_grad=True)  # 7: a prompt token, unseen
    cfg = LossConfig(name="value", value_clip=0.2)
    loss = LOSSES_BY_HEAD["value"][0](v, batch, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (0.16 + 0.09 + 1.0) / 3, rel=1e-6)
    assert v.grad.tolist()[0] == pytest.approx([0.0, (0.6 - 1) / 3, 0.0, (0.0 - 1) / 3], abs=1e-6)
    sums = LOSSES_BY_HEAD["value"][1](v, batch, cfg)
    assert sums["value_clip_frac"].item() == 2 and sums["value_mean"].item() == pytest.approx(1.6)
    with pytest.raises(ValueError, match="values and returns"):
        LOSSES_BY_HEAD["value"][0](v, collate(EPS[:1], pad_id=0), cfg)


def test_explained_variance_by_hand():
    returns = torch.tensor([[0.0, 1.0, 0.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last entry is not a token
    assert explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 0.5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(returns + 0.3, returns, mask) == pytest.approx(1.0)  # a constant offset: no variance
    assert explained_variance(1 - returns, returns, mask) == pytest.approx(1 - 1.0 / 0.25)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask))


def test_whitening_and_explained_variance_hold_any_reward_a_run_accepts():
    """A reward up to float32's largest is accepted (forge.types.MAX_REWARD): an episode's
    reward of 1e20 makes GAE's advantages 1e20, whose squares overflow float32. The batch's
    whitened advantages are still those of any scale (whitening is scale-free), not 0 for every
    token, and the explained variance of a constant guess is 0, not NaN."""
    batch = collate([Episode([1, 5], [0, 1], [0.0] * 2)] * 4, pad_id=0)
    values = torch.zeros(batch.input_ids.shape)
    for scale in (1.0, 1e20):
        adv, ret = gae(batch, values, torch.tensor([1.0, 0.0, 0.0, 0.0]) * scale)
        own = batch.loss_mask > 0
        w = whiten(adv, own)
        assert w[:, 1].tolist() == pytest.approx([3**0.5, -(3**-0.5), -(3**-0.5), -(3**-0.5)], rel=1e-5)
        assert explained_variance(values, ret, own) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name", ["grpo", "gspo", "dr_grpo"])
def test_an_episode_recorded_as_several_samples_weighs_as_one(name):
    """A multi-turn episode the gateway recorded as two samples (Episode.part: a turn re-rendered
    its history) trains as the one sample it would be whole: the per-episode losses count it
    once, each token's gradient as laid out whole; and split over micro-batches (the trainer's
    shares of loss_units), the same."""
    from services.trainer import _rows

    whole = Episode([1, 5, 8, 6, 6, 6], [0, 1, 0, 1, 1, 1], [-1.0] * 6, advantage=1.0)
    parts = [
        Episode([1, 5], [0, 1], [-1.0] * 2, advantage=1.0, part=("x", 0)),
        Episode([1, 5, 8, 6, 6, 6], [0, 0, 0, 1, 1, 1], [-1.0] * 6, advantage=1.0, part=("x", 1)),
    ]
    other = Episode([1, 7, 7], [0, 1, 1], [-1.0] * 3, advantage=-1.0)
    cfg = LossConfig(name=name, norm_tokens=8)

    def grads(episodes, split=False):
        batch = collate(episodes, pad_id=0)
        lp = batch.gen_logprobs.clone().requires_grad_()
        micro = [batch] if not split else [_rows(batch, slice(i, i + 1)) for i in range(batch.input_ids.shape[0])]
        total = sum(loss_units(name, mb) for mb in micro)
        for i, mb in enumerate(micro):
            rows = lp if not split else lp[i : i + 1]
            loss = get_loss(name)(rows, mb, torch.ones_like(rows), cfg) * loss_units(name, mb) / total
            loss.backward(retain_graph=True)
        own = batch.loss_mask > 0
        return [g for d in range(len(episodes)) for g in lp.grad[(batch.doc_ids == d) & own].tolist()], total

    want, units = grads([whole, other])
    for split in (False, True):
        got, got_units = grads([*parts, other], split)
        assert got == pytest.approx(want, abs=1e-6) and float(got_units) == pytest.approx(float(units)), (split, got)
