"""The fast path's token pick (rollout.engines.hf_fast.pick): exact draws, greedy, logprobs."""

from __future__ import annotations

import torch

from rollout.engines.hf_fast import pick


def test_exponential_race_draws_from_softmax_over_temperature():
    """100k draws from 5 outcomes at T = 0.7: frequencies within 0.01 total variation of
    softmax(logits / 0.7) (the expected TV of correct draws is about 0.003); sampling at T = 1 instead
    would be about 0.06 off, ignoring the noise (argmax) 0.5 off."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0]).expand(100_000, 5)
    tok, lp = pick(logits, torch.tensor(0.7), torch.Generator().manual_seed(0))
    probs = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tok, minlength=5).float() / tok.numel()
    assert 0.5 * (freq - probs).abs().sum().item() < 0.01
    torch.testing.assert_close(lp, probs.log()[tok], rtol=0, atol=1e-6)  # logprob of the drawn token


def test_greedy_is_argmax_with_untempered_logprobs():
    logits = torch.tensor([[0.5, 3.0, -1.0], [2.0, 0.0, 1.0]])
    tok, lp = pick(logits, None)
    assert tok.tolist() == [1, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
