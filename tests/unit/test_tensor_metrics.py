"""Device-side loss metrics (distrl.learn.tensor_metrics): values by hand, empty batches, one conversion."""

import math

import pytest
import torch

from distrl.learn.losses import LossConfig, Normalizer, policy_loss
from distrl.learn.offpolicy import OffPolicyConfig
from distrl.learn.tensor_metrics import masked_stats, to_floats


def test_masked_stats_by_hand():
    x = torch.tensor([[1.0, 5.0, -2.0], [float("inf"), 3.0, 0.5]])  # the inf is masked out
    keep = torch.tensor([[True, False, True], [False, True, True]])
    mean, high, low = masked_stats(x, keep, keep.sum(), empty=7.0)
    assert mean.dim() == 0 and mean.dtype == torch.float32
    assert mean.item() == pytest.approx((1.0 - 2.0 + 3.0 + 0.5) / 4)
    assert high.item() == 3.0 and low.item() == -2.0


def test_masked_stats_empty_gives_the_default():
    keep = torch.zeros(2, 3, dtype=torch.bool)
    assert [v.item() for v in masked_stats(torch.randn(2, 3), keep, keep.sum(), empty=1.0)] == [1.0, 1.0, 1.0]


def test_to_floats_converts_tensors_and_keeps_the_rest():
    parts = [{"a": torch.tensor(1.5), "n": torch.tensor(3), "b": 2.0}, {"a": torch.tensor([0.25])}]
    out = to_floats(parts)
    assert out == [{"a": 1.5, "n": 3.0, "b": 2.0}, {"a": 0.25}]
    assert all(type(v) is float for p in out for v in p.values())
    assert isinstance(parts[0]["a"], torch.Tensor)  # the inputs are left as they were
    with pytest.raises(ValueError, match="'v' must be a scalar"):
        to_floats([{"v": torch.ones(2)}])


@pytest.mark.parametrize("kind,off", [("grpo", OffPolicyConfig()), ("grpo", OffPolicyConfig("tis", 1.5)),
                                      ("pg", OffPolicyConfig("tis", 2.0, level="sequence"))])
def test_policy_loss_sync_false_matches_floats(kind, off):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen) * 2
    behavior = logp + 0.3 * torch.randn(3, 5, generator=gen)
    adv = torch.tensor([1.0, -0.5, 0.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    cfg = LossConfig(kind=kind, off_policy=off, kl_coef=0.1)
    norm = Normalizer("token-mean", 8.0, 3.0)
    ref = logp - 0.1
    loss_f, floats = policy_loss(logp, behavior, adv, mask, norm, cfg, ref_logprobs=ref)
    loss_t, tensors = policy_loss(logp, behavior, adv, mask, norm, cfg, ref_logprobs=ref, sync=False)
    assert all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in tensors.values())
    assert to_floats([tensors])[0] == floats
    assert loss_t.item() == loss_f.item()
    keep = mask > 0
    diff = (logp - behavior)[keep]  # by hand, with boolean indexing (the old way)
    assert floats["masked_tokens"] == 8.0
    assert floats["logprob_mismatch_mean_abs"] == pytest.approx(diff.abs().mean().item(), rel=1e-6)
    assert floats["logprob_mismatch_max_abs"] == pytest.approx(diff.abs().max().item(), rel=1e-6)
    assert floats["kl_behavior_learner_k3"] == pytest.approx((torch.expm1(diff) - diff).mean().item(), rel=1e-5)
    if kind == "grpo" and off.method == "none":
        ratio = torch.exp(diff)
        assert floats["ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-6)
        a = adv[:, None].expand(3, 5)[keep]
        clipped = ((a < 0) & (ratio < 0.8)) | ((a > 0) & (ratio > 1.2))
        assert floats["clip_fraction"] == pytest.approx(clipped.float().mean().item())


def test_policy_loss_empty_batch_metrics():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), Normalizer("token-mean", 0.0, 0.0),
                          LossConfig(kind="grpo", off_policy=OffPolicyConfig("tis", 2.0)))
    assert m["masked_tokens"] == 0.0 and m["ratio_mean"] == 1.0 and m["is_weight_max"] == 1.0
    assert m["clip_fraction"] == 0.0 and m["logprob_mismatch_max_abs"] == 0.0
    assert all(math.isfinite(v) for v in m.values())
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0
