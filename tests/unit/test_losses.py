"""learn.losses against hand arithmetic, plus the micro-batch invariant (TRL's invariant-test style)."""

import math

import pytest
import torch

from learn.losses import grpo_loss, pg_loss

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
