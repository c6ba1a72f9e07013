"""learn.logprobs.token_logprobs against a direct (unchunked) log-softmax reference."""

import pytest
import torch

from learn.logprobs import head_impl, token_logprobs

B, T, H, V = 2, 5, 8, 11
TEMP = 0.7


def _inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    head = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    targets = torch.randint(0, V, (B, T), generator=g)
    return hidden, head, targets


def _reference(hidden, weight, bias, targets, dtype):
    """Direct log_softmax over the full (B, T, V) logits: the thing the chunked code avoids."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    logp_all = torch.log_softmax(logits / TEMP, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("chunk", [1, 7, 1000])  # 1000 > B*T = 10: a single chunk
def test_matches_fp64_reference(chunk):
    hidden, head, targets = _inputs()
    logp, ent = token_logprobs(hidden, head, targets, TEMP, chunk_tokens=chunk, return_entropy=True)
    ref, ref_ent = _reference(hidden, head.weight, head.bias, targets, torch.float64)
    assert logp.shape == (B, T) and logp.dtype == torch.float32
    assert (logp.double() - ref).abs().max().item() < 1e-5
    assert (ent.double() - ref_ent).abs().max().item() < 1e-5
    assert not ent.requires_grad


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_gradients_match_unchunked(chunk, as_tensor):
    hidden, head, targets = _inputs(seed=1, bias=not as_tensor)
    upstream = torch.randn(B, T, generator=torch.Generator().manual_seed(2))  # arbitrary dL/dlogp

    h1 = hidden.clone().requires_grad_(True)
    lm = head.weight if as_tensor else head
    (token_logprobs(h1, lm, targets, TEMP, chunk_tokens=chunk) * upstream).sum().backward()
    got = (h1.grad, head.weight.grad.clone(), None if head.bias is None else head.bias.grad.clone())

    head.zero_grad()
    h2 = hidden.clone().requires_grad_(True)
    ref, _ = _reference(h2, head.weight, head.bias, targets, torch.float32)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(got[0], h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], head.weight.grad, atol=1e-5, rtol=1e-5)
    if head.bias is not None:
        torch.testing.assert_close(got[2], head.bias.grad, atol=1e-5, rtol=1e-5)


def test_no_full_logits_saved_for_backward():
    # Autograd outside the checkpointed chunks saves nothing the size of the full logits.
    hidden, head, targets = _inputs()
    hidden.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logprobs(hidden, head, targets, TEMP, chunk_tokens=3)
    # a direct log_softmax would save (B, T, V) logits here; the chunks save only their inputs
    assert saved and not any(shape[-1] == V and len(shape) > 1 for shape in saved), saved
    out.sum().backward()  # still differentiable
    assert torch.isfinite(hidden.grad).all()


def test_low_precision_inputs_give_fp32_output():
    hidden, head, targets = _inputs()
    hidden_bf16, head_bf16 = hidden.bfloat16(), head.to(torch.bfloat16)
    logp = token_logprobs(hidden_bf16, head_bf16, targets, TEMP, chunk_tokens=4)
    # fp32 from the head on: equals the fp64 reference of the bf16-rounded values
    ref, _ = _reference(hidden_bf16, head_bf16.weight, head_bf16.bias, targets, torch.float64)
    assert logp.dtype == torch.float32
    assert (logp.double() - ref).abs().max().item() < 1e-5


def test_negative_targets_ignored_and_validation():
    hidden, head, targets = _inputs()
    targets[1, 3:] = -100
    logp = token_logprobs(hidden, head, targets, TEMP, chunk_tokens=4)
    assert (logp[1, 3:] == 0).all() and (logp[0] < 0).all()
    with pytest.raises(ValueError):
        token_logprobs(hidden, head, targets, 0.0)
    with pytest.raises(ValueError):
        token_logprobs(hidden, head, targets[:, :2], TEMP)
    with pytest.raises(ValueError, match="impl"):
        token_logprobs(hidden, head, targets, TEMP, impl="triton")


def test_head_impl_resolution_on_cpu():
    """`--learner_head auto` falls back to the chunked head where Cut Cross-Entropy cannot run, naming
    why; asking for cce there is an error naming the flag."""
    head = torch.nn.Linear(8, 32, bias=False).to(torch.bfloat16)
    assert head_impl("chunked", head, 1.0) == ("chunked", "asked for")
    impl, why = head_impl("auto", head, 1.0)
    assert impl == "chunked" and "CUDA" in why
    assert head_impl("auto", torch.nn.Linear(8, 32), 1.0)[1] == "the head is not a bias-free Linear"
    with pytest.raises(ValueError, match="--learner_head cce"):
        head_impl("cce", head, 1.0)
    with pytest.raises(ValueError, match="--learner_head must be one of"):
        head_impl("fast", head, 1.0)
