"""distrl.learn.losses against hand arithmetic for every loss x aggregation mode, the KL estimators, and the
micro-batch invariant (TRL's invariant-test style). TRL itself: tests/unit/test_losses_trl.py."""

import math

import pytest
import torch

from distrl.learn.losses import KL_ESTIMATORS, LossConfig, Normalizer, grpo_loss, pg_loss, policy_loss
from distrl.learn.offpolicy import OffPolicyConfig

# B=2, T=3; the second completion has 2 tokens and one padding position.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
NUM_TOKENS = 5


def test_pg_loss_hand_arithmetic():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, -9.0]], requires_grad=True)
    behavior = torch.tensor([[-1.5, -2.0, -0.5], [-0.2, -0.1, 0.0]])
    adv = torch.tensor([0.5, -1.0])
    loss, m = pg_loss(logprobs, adv, MASK, NUM_TOKENS, behavior_logprobs=behavior)
    # sum A_i * logp_it * mask_it = 0.5 * (-1 - 2 - 0.5) + (-1) * (-0.2 - 0.4) = -1.75 + 0.6 = -1.15
    # loss = -(-1.15) / 5 = 0.23 (the padded -9.0 does not count)
    assert loss.item() == pytest.approx(0.23, abs=1e-6)
    loss.backward()
    # d loss / d logp_it = -A_i * mask_it / 5: row 0: -0.1; row 1: +0.2, +0.2, 0 (padding)
    expected = torch.tensor([[-0.1, -0.1, -0.1], [0.2, 0.2, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)
    # |logp - behavior| on the 5 tokens: 0.5, 0, 0, 0, 0.3 -> mean 0.16, max 0.5
    assert m["logprob_mismatch_mean_abs"] == pytest.approx(0.16, abs=1e-6)
    assert m["logprob_mismatch_max_abs"] == pytest.approx(0.5, abs=1e-6)
    # k3 = r - 1 - log r with log r = logp - behavior: 0.5 -> e^0.5 - 1.5; -0.3 -> e^-0.3 - 0.7
    k3 = ((math.exp(0.5) - 1.5) + (math.exp(-0.3) - 0.7)) / 5
    assert m["kl_behavior_learner_k3"] == pytest.approx(k3, abs=1e-6)
    assert m["masked_tokens"] == 5.0


def _grpo_inputs():
    # Ratios r = exp(logp - behavior) chosen by hand; clip_eps = 0.2 -> band [0.8, 1.2].
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 1.0]])
    behavior = torch.tensor([[-1.0, -2.0, -0.3], [-0.7, -1.2, 0.0]])
    logprobs = (behavior + ratios.log()).clone()
    logprobs[1, 2] = float("-inf")  # padding may hold anything
    return logprobs.requires_grad_(True), behavior, torch.tensor([1.0, -2.0])


def test_grpo_loss_hand_arithmetic_and_clipping():
    logprobs, behavior, adv = _grpo_inputs()
    loss, m = grpo_loss(logprobs, behavior, adv, MASK, NUM_TOKENS, clip_eps=0.2)
    # Row 0, A = +1:
    #   r=1.5: min(1.5, 1.2) = 1.2  clipped (above band, A>0)       term -1.2, grad 0
    #   r=0.5: min(0.5, 0.8) = 0.5  unclipped (below band but A>0)  term -0.5, d/dlogp = -r*A = -0.5
    #   r=1.1: in band               = 1.1                          term -1.1, d/dlogp = -1.1
    # Row 1, A = -2:
    #   r=0.5: min(-1.0, 0.8*-2=-1.6) = -1.6 clipped (below band, A<0) term +1.6, grad 0
    #   r=1.5: min(-3.0, 1.2*-2=-2.4) = -3.0 unclipped (above, A<0)    term +3.0, d/dlogp = -r*A = 3.0
    # sum = -1.2 - 0.5 - 1.1 + 1.6 + 3.0 = 1.8; loss = 1.8 / 5 = 0.36
    assert loss.item() == pytest.approx(0.36, abs=1e-6)
    loss.backward()
    expected = torch.tensor([[0.0, -0.5, -1.1], [0.0, 3.0, 0.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)
    assert torch.isfinite(logprobs.grad).all()
    # clipped term active on 2 of 5 tokens
    assert m["clip_fraction"] == pytest.approx(0.4)
    # ratio mean (1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5 = 5.1 / 5 = 1.02; max 1.5, min 0.5
    assert m["ratio_mean"] == pytest.approx(1.02, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    assert m["ratio_min"] == pytest.approx(0.5, abs=1e-6)
    # |log r|: 2 * ln 1.5 + 2 * ln 2 + ln 1.1 = 0.81093 + 1.38629 + 0.09531 = 2.29253 -> / 5 = 0.45851
    assert m["logprob_mismatch_mean_abs"] == pytest.approx(
        (2 * math.log(1.5) + 2 * math.log(2) + math.log(1.1)) / 5, abs=1e-6)
    assert m["logprob_mismatch_max_abs"] == pytest.approx(math.log(2), abs=1e-6)
    # k3 = r - 1 - ln r: 1.5 -> 0.094535, 0.5 -> 0.193147, 1.1 -> 0.004690
    # mean = (2 * 0.094535 + 2 * 0.193147 + 0.004690) / 5 = 0.116011
    k3 = (2 * (0.5 - math.log(1.5)) + 2 * (-0.5 + math.log(2)) + (0.1 - math.log(1.1))) / 5
    assert m["kl_behavior_learner_k3"] == pytest.approx(k3, abs=1e-6)


def test_grpo_ratio_is_real_not_one():
    # All ratios in band (r = 1.1): grpo grad = -r * A / N, pg grad = -A / N -> they differ by r.
    behavior = torch.full((2, 3), -1.0)
    lp_grpo = (behavior + math.log(1.1)).requires_grad_(True)
    lp_pg = lp_grpo.detach().clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    grpo_loss(lp_grpo, behavior, adv, MASK, NUM_TOKENS)[0].backward()
    pg_loss(lp_pg, adv, MASK, NUM_TOKENS)[0].backward()
    torch.testing.assert_close(lp_grpo.grad, 1.1 * lp_pg.grad)
    assert not torch.allclose(lp_grpo.grad, lp_pg.grad)
    # On-policy (behavior == learner): ratio 1, and the GRPO gradient equals the PG gradient.
    lp_on = behavior.clone().requires_grad_(True)
    loss_on, m = grpo_loss(lp_on, behavior, adv, MASK, NUM_TOKENS)
    loss_on.backward()
    torch.testing.assert_close(lp_on.grad, lp_pg.grad)
    assert m["ratio_mean"] == 1.0 and m["clip_fraction"] == 0.0


def test_behavior_logprobs_get_no_gradient():
    logprobs, behavior, adv = _grpo_inputs()
    behavior.requires_grad_(True)
    grpo_loss(logprobs, behavior, adv, MASK, NUM_TOKENS)[0].backward()
    assert behavior.grad is None


@pytest.mark.parametrize("which", ["pg", "grpo"])
def test_equal_rewards_group_gives_zero_loss_and_finite_grads(which):
    # A group whose rewards are all equal has advantages all 0 after the group-mean baseline.
    logprobs, behavior, _ = _grpo_inputs()
    adv = torch.zeros(2)
    if which == "pg":
        loss, m = pg_loss(logprobs, adv, MASK, NUM_TOKENS, behavior_logprobs=behavior)
    else:
        loss, m = grpo_loss(logprobs, behavior, adv, MASK, NUM_TOKENS)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and (logprobs.grad == 0).all()
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("which", ["pg", "grpo"])
def test_batch_without_tokens(which):
    logprobs = torch.randn(2, 3, requires_grad=True)
    behavior, mask, adv = torch.randn(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0])
    if which == "pg":
        loss, m = pg_loss(logprobs, adv, mask, 0, behavior_logprobs=behavior)
    else:
        loss, m = grpo_loss(logprobs, behavior, adv, mask, 0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert (logprobs.grad == 0).all()
    assert all(math.isfinite(v) for v in m.values()) and m["masked_tokens"] == 0.0


@pytest.mark.parametrize("which", ["pg", "grpo"])
def test_micro_batches_sum_to_full_batch(which):
    # Invariant: 2 micro-batches of 2 completions, each divided by the whole batch's token count,
    # summed == the batch of 4; gradients accumulated over micro-batches == full-batch gradients.
    g = torch.Generator().manual_seed(0)
    behavior = -torch.rand(4, 6, generator=g) * 3
    learner = behavior + 0.4 * torch.randn(4, 6, generator=g)  # ratios on both sides of the band
    adv = torch.tensor([1.0, -0.5, 0.0, -0.5])
    lengths = torch.tensor([6, 2, 4, 5])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    num_tokens = int(mask.sum())  # 17

    def loss_fn(lp, sl):
        if which == "pg":
            return pg_loss(lp[sl], adv[sl], mask[sl], num_tokens, behavior_logprobs=behavior[sl])[0]
        return grpo_loss(lp[sl], behavior[sl], adv[sl], mask[sl], num_tokens)[0]

    full_lp = learner.clone().requires_grad_(True)
    full = loss_fn(full_lp, slice(0, 4))
    full.backward()
    micro_lp = learner.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 4)):
        part = loss_fn(micro_lp, sl)
        part.backward()  # gradient accumulation
        total = total + part.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad)
    if which == "grpo":
        assert grpo_loss(learner, behavior, adv, mask, num_tokens)[1]["clip_fraction"] > 0


def test_shape_errors():
    with pytest.raises(ValueError):
        pg_loss(torch.zeros(2, 3), torch.zeros(3), MASK, 5)
    with pytest.raises(ValueError):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), MASK, 5)


# ---- every loss x aggregation mode, by hand --------------------------------------------------
# Normalizers of the batch above: N_tok = 5 tokens, N_seq = 2 completions (lengths T_0 = 3, T_1 = 2),
# C = 4 tokens for sequence-mean-token-sum-norm.
TOKEN, SEQ, NORM = "token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"


def _norm(mode):
    return Normalizer(mode, num_tokens=5, num_sequences=2, norm_tokens=4)


# pg: l_it = -A_i logp_it with logp = [[-1, -2, -.5], [-.2, -.4, pad]], A = [.5, -1]
#   row 0: .5, 1, .25 (sum 1.75); row 1: -.2, -.4 (sum -.6); d l / d logp = -A_i: row 0 -.5, row 1 +1
# grpo (clip .2): row 0 terms -1.2, -.5, -1.1 (sum -2.8), grads 0, -.5, -1.1;
#                 row 1 terms 1.6, 3.0 (sum 4.6), grads 0, 3.0  (see test_grpo_loss_hand_arithmetic...)
# token-mean: sum / 5;  seq-mean-token-mean: (sum_0 / 3 + sum_1 / 2) / 2;  sum-norm: (sum_0 + sum_1) / (2 * 4)
HAND = {
    ("pg", TOKEN): ((1.75 - 0.6) / 5, [[-0.5 / 5] * 3, [1 / 5, 1 / 5, 0]]),
    ("pg", SEQ): ((1.75 / 3 - 0.6 / 2) / 2, [[-0.5 / 6] * 3, [1 / 4, 1 / 4, 0]]),
    ("pg", NORM): ((1.75 - 0.6) / 8, [[-0.5 / 8] * 3, [1 / 8, 1 / 8, 0]]),
    ("grpo", TOKEN): (1.8 / 5, [[0, -0.5 / 5, -1.1 / 5], [0, 3.0 / 5, 0]]),
    ("grpo", SEQ): ((-2.8 / 3 + 4.6 / 2) / 2, [[0, -0.5 / 6, -1.1 / 6], [0, 3.0 / 4, 0]]),
    ("grpo", NORM): (1.8 / 8, [[0, -0.5 / 8, -1.1 / 8], [0, 3.0 / 8, 0]]),
}


@pytest.mark.parametrize("kind,mode", sorted(HAND))
def test_every_loss_and_aggregation_by_hand(kind, mode):
    if kind == "pg":
        logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, float("nan")]], requires_grad=True)
        behavior, adv = logprobs.detach().clone(), torch.tensor([0.5, -1.0])
    else:
        logprobs, behavior, adv = _grpo_inputs()
    loss, m = policy_loss(logprobs, behavior, adv, MASK, _norm(mode), LossConfig(kind=kind))
    value, grad = HAND[(kind, mode)]
    assert loss.item() == pytest.approx(value, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad))
    assert m["masked_tokens"] == 5.0


def test_dr_grpo_is_grpo_with_sum_norm_and_unnormalized_advantages():
    # Dr.GRPO = clipped ratio, advantages r - mean(r) (distrl.core.advantages "dr_grpo"), token sum / C.
    from distrl.core.advantages import group_advantages

    logprobs, behavior, _ = _grpo_inputs()
    adv = torch.tensor(group_advantages([1.0, -1.0], "dr_grpo"))  # [1, -1]: no std division
    loss, _ = policy_loss(logprobs, behavior, adv, MASK, _norm(NORM), LossConfig(kind="grpo"))
    # row 0 (A=+1): -1.2 - .5 - 1.1 = -2.8; row 1 (A=-1): r=.5 -> min(-.5, -.8) = -.8 -> +.8;
    #   r=1.5 -> min(-1.5, -1.2) = -1.5 -> +1.5; sum = -2.8 + 2.3 = -.5; / (2 * 4) = -.0625
    assert loss.item() == pytest.approx(-0.0625, abs=1e-6)


def test_asymmetric_clip_by_hand():
    # eps_low .2, eps_high .6: band [.8, 1.6].
    # row 0 (A=+1): r=1.5 now inside -> -1.5 (grad -1.5); r=.5 -> -.5; r=1.1 -> -1.1      sum -3.1
    # row 1 (A=-2): r=.5 -> min(-1, -1.6) = -1.6 clipped low; r=1.5 -> min(-3, -3) = -3 -> sum 4.6
    # token-mean: 1.5 / 5 = .3; clipped: 1 of 5 tokens, all on the low side
    logprobs, behavior, adv = _grpo_inputs()
    loss, m = policy_loss(logprobs, behavior, adv, MASK, _norm(TOKEN),
                          LossConfig(kind="grpo", clip_eps_low=0.2, clip_eps_high=0.6))
    assert loss.item() == pytest.approx(0.3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.5, -0.5, -1.1], [0.0, 3.0, 0.0]]) / 5)
    assert (m["clip_fraction"], m["clip_fraction_low"], m["clip_fraction_high"]) == pytest.approx((0.2, 0.2, 0.0))


# KL by hand: logp = [-1, -2], ref = [-1.5, -1], d = ref - logp = [-.5, 1]
#   k1 = -d = [.5, -1]                       d/dlogp = 1
#   k2 = d^2 / 2 = [.125, .5]                d/dlogp = -d = [.5, -1]
#   k3 = e^d - d - 1 = [.1065307, .7182818]  d/dlogp = 1 - e^d = [.3934693, -1.7182818]
KL_HAND = {
    "k1": ([0.5, -1.0], [1.0, 1.0]),
    "k2": ([0.125, 0.5], [0.5, -1.0]),
    "k3": ([math.exp(-0.5) - 0.5, math.e - 2], [1 - math.exp(-0.5), 1 - math.e]),
}


@pytest.mark.parametrize("estimator", sorted(KL_HAND))
def test_kl_term_by_hand(estimator):
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    cfg = LossConfig(kind="grpo", kl_coef=0.1, kl_estimator=estimator)
    norm = Normalizer(TOKEN, num_tokens=2, num_sequences=1)
    # advantages 0: the policy term vanishes, the loss is 0.1 * mean_t kl_t
    loss, m = policy_loss(logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 2), norm, cfg, ref_logprobs=ref)
    values, grads = KL_HAND[estimator]
    assert loss.item() == pytest.approx(0.1 * sum(values) / 2, abs=1e-6)
    assert m["kl_ref"] == pytest.approx(sum(values) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, 0.1 * torch.tensor([grads]) / 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 2), norm, cfg)


def test_kl_is_zero_when_policy_equals_reference():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    for est in KL_ESTIMATORS:
        loss, m = policy_loss(logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 2),
                              Normalizer(TOKEN, 2, 1), LossConfig(kl_coef=1.0, kl_estimator=est),
                              ref_logprobs=logprobs.detach())
        assert loss.item() == 0.0 and m["kl_ref"] == 0.0


OFF = [OffPolicyConfig(), OffPolicyConfig("tis", cap=1.5), OffPolicyConfig("tis", cap=1.5, level="sequence"),
       OffPolicyConfig("decoupled", cap=1.5, mask_low=0.5, mask_high=2.0)]


@pytest.mark.parametrize("mode", [TOKEN, SEQ, NORM])
@pytest.mark.parametrize("kind", ["pg", "grpo"])
@pytest.mark.parametrize("off", range(len(OFF)))
def test_micro_batches_equal_full_batch_every_aggregation(mode, kind, off):
    # Invariant (TRL's tests/invariant style): micro-batches of 1, 2 and 3 completions, each normalized by
    # the WHOLE batch's constants, sum to the full-batch loss and gradient, for every mode and correction.
    g = torch.Generator().manual_seed(1)
    behavior = -torch.rand(5, 6, generator=g) * 3
    learner = behavior + 0.4 * torch.randn(5, 6, generator=g)
    ref = behavior + 0.2 * torch.randn(5, 6, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.0, -0.5, 2.0])
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 5, 1])[:, None]).float()
    norm = Normalizer(mode, num_tokens=float(mask.sum()), num_sequences=5.0, norm_tokens=6.0)
    cfg = LossConfig(kind=kind, kl_coef=0.05, off_policy=OFF[off])

    def run(slices):
        lp = learner.clone().requires_grad_(True)
        total = 0.0
        for sl in slices:
            part, _ = policy_loss(lp[sl], behavior[sl], adv[sl], mask[sl], norm, cfg, ref_logprobs=ref[sl])
            part.backward()
            total += part.item()
        return total, lp.grad

    full, full_grad = run([slice(0, 5)])
    for slices in ([slice(i, i + 1) for i in range(5)], [slice(0, 2), slice(2, 5)]):
        total, grad = run(slices)
        assert total == pytest.approx(full, abs=1e-6)
        torch.testing.assert_close(grad, full_grad)


def test_normalizer_and_config_errors():
    with pytest.raises(ValueError, match="aggregation"):
        Normalizer("mean", 1, 1)
    with pytest.raises(ValueError, match="norm_tokens"):
        Normalizer(NORM, 1, 1, norm_tokens=0)
    with pytest.raises(ValueError, match="KL estimator"):
        LossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="loss"):
        LossConfig(kind="ppo")
