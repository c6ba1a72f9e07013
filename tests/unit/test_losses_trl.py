"""distrl.learn.losses against TRL's GRPO loss (reference test; TRL pinned in pyproject's `test` extra: 1.15.0).

TRL's loss is driven for real: a ``trl.GRPOTrainer`` is built on the tiny model, its per-token logprob
function is replaced by one returning OUR logprobs tensor (a leaf), and ``GRPOTrainer._compute_loss`` runs
on an inputs dict holding the same advantages, mask, "old" logprobs and, where used, reference logprobs
and importance-sampling ratios. Loss values and gradients w.r.t. the logprobs must agree to 1e-5 (fp32).

Which TRL ``loss_type`` each of our configurations matches (one process, no gradient accumulation):

| ours                                                   | TRL 1.15.0                                          |
|--------------------------------------------------------|-----------------------------------------------------|
| grpo, sequence-mean-token-mean, off_policy none        | ``grpo`` with old_per_token_logps = behavior        |
| grpo, token-mean                                        | ``bnpo``; ``dapo`` (num_items_in_batch = tokens)    |
| dr_grpo (grpo, sequence-mean-token-sum-norm, C)        | ``dr_grpo`` with max_completion_length = C          |
| grpo + KL (k3, kl_coef)                                 | any of the above with beta = kl_coef and            |
|                                                        | use_bias_correction_kl=False (TRL's default True    |
|                                                        | multiplies the KL by exp(logp - old), DeepSeek-V3.2)|
| grpo, tis token / sequence, decoupled                   | ``use_vllm`` IS correction ``token_truncate`` /     |
|                                                        | ``sequence_truncate``, old = proximal               |
| pg, token-mean (+ tis)                                  | ``cispo`` with old = current logprobs (+ IS ratio)  |

TRL computes its IS ratio in ``_generate_and_score_completions`` (which needs a vLLM server); here the
ratio is computed as TRL does it there (grpo_trainer.py, "Compute the importance sampling ratio when using
vLLM") and passed in ``inputs["importance_sampling_ratio"]``; ``trainer.use_vllm`` is set to True only so
that ``_compute_loss`` applies it.
"""

from __future__ import annotations

import pytest
import torch

from distrl.learn.losses import LossConfig, Normalizer, policy_loss
from distrl.learn.offpolicy import OffPolicyConfig

trl = pytest.importorskip("trl")

B, T = 4, 5
CAP = 2.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distrl.core.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("trl") / "tiny", seed=0)


def _trainer(tiny, tmp_path, loss_type, beta=0.0, eps_high=0.28):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), loss_type=loss_type, beta=beta, epsilon=0.2,
                      epsilon_high=eps_high, per_device_train_batch_size=B, num_generations=B,
                      max_completion_length=T, report_to=[], use_cpu=True,
                      use_bias_correction_kl=False)  # TRL 1.15's default weights the KL by the ratio (below)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(tiny)),
                          reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["ab"] * B}),
                          processing_class=AutoTokenizer.from_pretrained(str(tiny)))
    trainer.model.train()  # mode "train": the normalizers of the training branch
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _data():
    """Per-token logprobs on both sides of the clip band, ragged completion lengths, finite padding."""
    g = torch.Generator().manual_seed(3)
    behavior = -torch.rand(B, T, generator=g) * 2 - 0.1
    logp = behavior + 0.3 * torch.randn(B, T, generator=g)
    prox = logp + 0.1 * torch.randn(B, T, generator=g)
    ref = logp + 0.2 * torch.randn(B, T, generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor([5, 3, 4, 1])[:, None]).float()
    adv = torch.tensor([1.2, -0.4, 0.0, -0.8])
    return logp, behavior, prox, ref, mask, adv


def _trl_is_ratio(prox, behavior, mask, level):
    """TRL's IS ratio (token_truncate / sequence_truncate), computed as grpo_trainer.py does."""
    diff = (prox - behavior) * mask
    if level == "sequence":
        diff = diff.sum(dim=-1, keepdim=True)
    return torch.clamp(torch.exp(diff), max=CAP)


def _run_trl(trainer, logp, mask, adv, old, ref=None, is_ratio=None):
    leaf = logp.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    inputs = {"prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        inputs["importance_sampling_ratio"] = is_ratio
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.item(), leaf.grad


def _run_ours(logp, behavior, mask, adv, mode, cfg, prox=None, ref=None, norm_tokens=1.0):
    leaf = logp.clone().requires_grad_(True)
    norm = Normalizer(mode, float(mask.sum()), float(B), norm_tokens)
    loss, _ = policy_loss(leaf, behavior, adv, mask, norm, cfg, proximal_logprobs=prox, ref_logprobs=ref)
    loss.backward()
    return loss.item(), leaf.grad


def _assert_same(trl_out, ours):
    grad_diff = (trl_out[1] - ours[1]).abs().max().item()
    print(f"loss TRL {trl_out[0]:+.8f} ours {ours[0]:+.8f} |dloss| {abs(trl_out[0] - ours[0]):.1e} "
          f"max |dgrad| {grad_diff:.1e}")
    assert abs(trl_out[0] - ours[0]) < 1e-5, (trl_out[0], ours[0])
    assert (trl_out[1] - ours[1]).abs().max().item() < 1e-5
    assert ours[1].abs().max() > 0  # not vacuous


GRPO = LossConfig(kind="grpo", clip_eps_low=0.2, clip_eps_high=0.28)
CASES = {  # name: (TRL loss_type, TRL beta, our aggregation, our config)
    "grpo": ("grpo", 0.0, "sequence-mean-token-mean", GRPO),
    "bnpo": ("bnpo", 0.0, "token-mean", GRPO),
    "dapo": ("dapo", 0.0, "token-mean", GRPO),
    "dr_grpo": ("dr_grpo", 0.0, "sequence-mean-token-sum-norm", GRPO),
    "grpo+kl": ("grpo", 0.04, "sequence-mean-token-mean",
                LossConfig(kind="grpo", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.04, kl_estimator="k3")),
    "dapo+kl": ("dapo", 0.04, "token-mean",
                LossConfig(kind="grpo", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.04, kl_estimator="k3")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_trl_without_correction(name, tiny, tmp_path):
    loss_type, beta, mode, cfg = CASES[name]
    logp, behavior, _, ref, mask, adv = _data()
    trainer = _trainer(tiny, tmp_path, loss_type, beta=beta)
    # off_policy none: the "old" policy of the ratio is the behavior policy
    trl_out = _run_trl(trainer, logp, mask, adv, old=behavior, ref=ref if beta else None)
    ours = _run_ours(logp, behavior, mask, adv, mode, cfg, ref=ref if beta else None, norm_tokens=float(T))
    _assert_same(trl_out, ours)


@pytest.mark.parametrize("method,level,loss_type,mode", [
    ("tis", "token", "bnpo", "token-mean"),
    ("tis", "sequence", "grpo", "sequence-mean-token-mean"),
    ("decoupled", "token", "dr_grpo", "sequence-mean-token-sum-norm"),
])
def test_matches_trl_importance_sampling(method, level, loss_type, mode, tiny, tmp_path):
    # TIS / decoupled: ratio against the proximal policy, times min(pi_prox / mu, C) (TRL's vLLM IS ratio)
    logp, behavior, prox, _, mask, adv = _data()
    trainer = _trainer(tiny, tmp_path, loss_type)
    trl_out = _run_trl(trainer, logp, mask, adv, old=prox, is_ratio=_trl_is_ratio(prox, behavior, mask, level))
    cfg = LossConfig(kind="grpo", clip_eps_low=0.2, clip_eps_high=0.28,
                     off_policy=OffPolicyConfig(method, cap=CAP, level=level))
    _assert_same(trl_out, _run_ours(logp, behavior, mask, adv, mode, cfg, prox=prox, norm_tokens=float(T)))


@pytest.mark.parametrize("method", ["none", "tis"])
def test_pg_matches_trl_cispo(method, tiny, tmp_path):
    # cispo: -clamp(r, max=eps_high).detach() * A * logp with r = exp(logp - old); old = logp.detach()
    # gives r = 1, i.e. REINFORCE; the vLLM IS ratio multiplies it like our TIS weight. Token-mean.
    logp, behavior, _, _, mask, adv = _data()
    trainer = _trainer(tiny, tmp_path, "cispo", eps_high=5.0)
    is_ratio = _trl_is_ratio(logp, behavior, mask, "token") if method == "tis" else None
    trl_out = _run_trl(trainer, logp, mask, adv, old=logp.clone(), is_ratio=is_ratio)
    cfg = LossConfig(kind="pg", off_policy=OffPolicyConfig(method, cap=CAP))
    _assert_same(trl_out, _run_ours(logp, behavior, mask, adv, "token-mean", cfg))


def test_trl_version_is_the_pinned_one():
    assert trl.__version__ == "1.15.0"
