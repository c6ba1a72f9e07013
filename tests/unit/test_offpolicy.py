"""distrl.learn.offpolicy (TIS, AReaL's decoupled objective, the ratio band) through distrl.learn.losses, by hand."""

import math

import pytest
import torch

from distrl.learn.losses import LossConfig, Normalizer, policy_loss
from distrl.learn.offpolicy import OffPolicyConfig, correction

# One completion of 3 tokens; behavior ratios rho = pi_prox / mu = [3, .5, 1], advantage +1.
RHO = torch.tensor([[3.0, 0.5, 1.0]])
BEHAVIOR = torch.tensor([[-1.0, -2.0, -0.5]])
LOGP = BEHAVIOR + RHO.log()
ONE = torch.ones(1, 3)
NORM = Normalizer("token-mean", num_tokens=3, num_sequences=1)


def _loss(kind, off, logp=None, prox=None, adv=1.0):
    lp = (LOGP if logp is None else logp).clone().requires_grad_(True)
    loss, m = policy_loss(lp, BEHAVIOR, torch.tensor([adv]), ONE, NORM, LossConfig(kind=kind, off_policy=off),
                          proximal_logprobs=prox)
    loss.backward()
    return loss.item(), lp.grad, m


@pytest.mark.parametrize("kind", ["pg", "grpo"])
def test_tis_token_by_hand(kind):
    # cap 2: w = min(rho, 2) = [2, .5, 1]. pg: l = -w A logp, grad -w A / 3.
    # grpo: old = pi_prox = logp (one step per version) -> r = 1, l = -w A, grad -w A r / 3.
    value, grad, m = _loss(kind, OffPolicyConfig("tis", cap=2.0))
    w = torch.tensor([[2.0, 0.5, 1.0]])
    torch.testing.assert_close(grad, -w / 3)
    expected = -(w * LOGP).sum().item() / 3 if kind == "pg" else -3.5 / 3
    assert value == pytest.approx(expected, abs=1e-6)
    assert m["is_ratio_mean"] == pytest.approx(1.5) and m["is_ratio_max"] == pytest.approx(3.0)
    assert m["is_ratio_min"] == pytest.approx(0.5)
    assert m["is_weight_mean"] == pytest.approx(3.5 / 3) and m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_truncated_fraction"] == pytest.approx(1 / 3) and m["band_masked_fraction"] == 0.0


def test_tis_sequence_by_hand():
    # sequence weight = min(3 * .5 * 1, C): C = 2 -> 1.5 on every token; C = 1.2 -> 1.2 (truncated)
    for cap, w in ((2.0, 1.5), (1.2, 1.2)):
        value, grad, m = _loss("grpo", OffPolicyConfig("tis", cap=cap, level="sequence"))
        assert value == pytest.approx(-w, abs=1e-6)  # -(3 tokens * w) / 3
        torch.testing.assert_close(grad, torch.full((1, 3), -w / 3))
        assert m["is_truncated_fraction"] == (1.0 if cap == 1.2 else 0.0)


def test_decoupled_by_hand_with_a_distinct_proximal_policy():
    # AReaL: l = -w min(u A, clip(u, .8, 1.2) A), u = pi / pi_prox, w = min(pi_prox / mu, C), C = 2.
    # pi_prox = behavior + log rho (w = [2, .5, 1]); the current policy moved: u = [1.5, 1.1, .5].
    u = torch.tensor([[1.5, 1.1, 0.5]])
    value, grad, m = _loss("grpo", OffPolicyConfig("decoupled", cap=2.0), logp=LOGP + u.log(), prox=LOGP)
    # token 0: min(1.5, 1.2) = 1.2 clipped (A > 0, above band) -> -2 * 1.2 = -2.4, grad 0
    # token 1: 1.1 in band -> -.5 * 1.1 = -.55, grad -.5 * 1.1 = -.55
    # token 2: min(.5, .8) = .5 (below band but A > 0: unclipped) -> -1 * .5, grad -.5
    # loss = (-2.4 - .55 - .5) / 3 = -1.15
    assert value == pytest.approx(-1.15, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.55, -0.5]]) / 3)
    assert m["clip_fraction"] == pytest.approx(1 / 3)
    assert m["ratio_max"] == pytest.approx(1.5) and m["is_ratio_max"] == pytest.approx(3.0)


def test_decoupled_equals_tis_token_with_one_step_per_version():
    _, g_dec, _ = _loss("grpo", OffPolicyConfig("decoupled", cap=2.0))
    _, g_tis, _ = _loss("grpo", OffPolicyConfig("tis", cap=2.0))
    _, g_pg, _ = _loss("pg", OffPolicyConfig("tis", cap=2.0))
    torch.testing.assert_close(g_dec, g_tis)
    torch.testing.assert_close(g_dec, g_pg)


@pytest.mark.parametrize("method", ["none", "tis", "decoupled"])
def test_band_mask_by_hand(method):
    # band [.6, 2.5] drops rho = 3 and rho = .5: only token 2 (rho = 1, weight 1) keeps its loss;
    # the normalizer still counts 3 tokens.
    value, grad, m = _loss("pg", OffPolicyConfig(method, cap=2.0, mask_low=0.6, mask_high=2.5))
    assert value == pytest.approx(0.5 / 3, abs=1e-6)  # -1 * 1 * (-.5) / 3
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1 / 3]]))
    assert m["band_masked_fraction"] == pytest.approx(2 / 3)


def test_none_takes_the_ratio_against_behavior():
    # grpo with no correction: r = pi / mu = rho = [3, .5, 1], A = +1, band [.8, 1.2]:
    # token 0: min(3, 1.2) -> -1.2 clipped (grad 0); token 1: min(.5, .8) = .5 -> grad -.5; token 2: -1, grad -1
    value, grad, m = _loss("grpo", OffPolicyConfig())
    assert value == pytest.approx(-(1.2 + 0.5 + 1.0) / 3, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -1.0]]) / 3)
    assert m["is_weight_mean"] == 1.0 and m["clip_fraction"] == pytest.approx(1 / 3)


def test_extreme_ratios_stay_finite():
    behavior = torch.tensor([[-80.0, 0.0, -1.0]])
    logp = torch.tensor([[0.0, -80.0, float("-inf")]])  # rho = e^80, e^-80, padding
    keep = torch.tensor([[True, True, False]])
    for off in (OffPolicyConfig("tis", 2.0), OffPolicyConfig("tis", 2.0, level="sequence"),
                OffPolicyConfig("decoupled", 2.0, mask_high=10.0)):
        c = correction(torch.where(keep, logp, 0), torch.where(keep, behavior, 0), keep, off)
        assert torch.isfinite(c.weights).all() and c.weights.max() <= 2.0
        assert all(math.isfinite(v) for k, v in c.metrics.items() if k != "is_ratio_max")


def test_config_errors():
    with pytest.raises(ValueError, match="method"):
        OffPolicyConfig("clip")
    with pytest.raises(ValueError, match="sequence-level"):
        OffPolicyConfig("decoupled", level="sequence")
    with pytest.raises(ValueError, match="cap"):
        OffPolicyConfig("tis", cap=0.5)
    with pytest.raises(ValueError, match="mask_high"):
        OffPolicyConfig(mask_low=2.0, mask_high=1.0)
