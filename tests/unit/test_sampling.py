"""The fast path's token pick (distrl.rollout.engines.hf.decode.pick): exact draws, greedy, logprobs; where the decode
kernels (distrl.rollout.engines.hf.kernels) run and how the split-K attention splits positions."""

from __future__ import annotations

import torch

from distrl.rollout.engines.hf.decode import pick


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


def test_decode_kernels_stay_off_where_they_cannot_run_and_split_positions_by_need():
    """distrl.rollout.engines.hf.kernels on this machine: no kernels for a CPU model (the sampler keeps the portable
    path; asking for them is a clear error), and the split-K attention's split count: two programs a multiprocessor at
    most, never more splits than blocks of positions."""
    import pytest
    from transformers import LlamaConfig, LlamaForCausalLM

    from distrl.rollout.engines.hf import kernels
    from distrl.rollout.engines.hf.continuous import ContinuousSampler

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    assert not kernels.available(model)
    args = (lambda: model, 0, torch.empty(0, dtype=torch.long), torch.Generator())
    assert ContinuousSampler(*args, cuda_graphs=False).kernels is False
    with pytest.raises(ValueError, match="decode kernels need"):
        ContinuousSampler(*args, cuda_graphs=False, kernels=True)
    with pytest.raises(ValueError, match="unknown decode_attention 'paged'"):
        ContinuousSampler(*args, cuda_graphs=False, decode_attention="paged")
    cpu = torch.device("cpu")  # counted as 132 multiprocessors (an H100/H200)
    assert kernels.decode_splits(1024, 2, 320, cpu) == 1
    assert kernels.decode_splits(8, 2, 320, cpu) == 5  # 17 wanted, 5 blocks of 64 positions
    assert kernels.decode_splits(8, 2, 4096, cpu) == 17
    assert kernels.decode_splits(1, 1, 10, cpu) == 1
    # the Triton attention takes head sizes that are powers of 2 from 16; others (Phi-2's 80) use FlashAttention
    assert [d for d in (8, 16, 64, 80, 96, 128, 256) if kernels.triton_head_dim(d)] == [16, 64, 128, 256]
    q = torch.zeros(1, 2, 1, 80)
    with pytest.raises(ValueError, match="power of 2 >= 16, not 80"):
        kernels.decode_attention(q, q, q, torch.ones(1, dtype=torch.int32), 1.0)
