"""distrl.learn.logprobs.token_logprobs against a direct (unchunked) log-softmax reference."""

import math

import pytest
import torch

from distrl.learn.logprobs import head_impl, token_logprobs

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
    """`--learner_head auto` takes halfmm only for a bf16/fp16 head on CUDA and falls back to the chunked
    head elsewhere, naming why; asking for cce where it cannot run is an error naming the flag."""
    head = torch.nn.Linear(8, 32, bias=False).to(torch.bfloat16)
    assert head_impl("chunked", head, 1.0) == ("chunked", "asked for")
    impl, why = head_impl("auto", head, 1.0)
    assert impl == "chunked" and why == "halfmm: the head is not on a CUDA device"
    assert head_impl("auto", torch.nn.Linear(8, 32), 1.0)[1] == "halfmm: the head is torch.float32, not bf16/fp16"
    assert head_impl("halfmm", head, 1.0) == ("halfmm", "asked for")  # on CPU when asked for (tests run it)
    with pytest.raises(ValueError, match="--learner_head cce"):
        head_impl("cce", head, 1.0)
    with pytest.raises(ValueError, match="--learner_head must be one of"):
        head_impl("fast", head, 1.0)


# ---- halfmm: the chunked algorithm with the matmuls in the head's half dtype ------------------------


def _bf16_inputs(seed, bias):
    hidden, head, targets = _inputs(seed=seed, bias=bias)
    targets[1, 3:] = -100  # ignored: logprob 0, no gradient
    return hidden.bfloat16(), head.to(torch.bfloat16), targets


def _fp32_autograd(hidden, weight, bias, targets, temperature, upstream):
    """Plain autograd on fp32 logits of the same (bf16) values: logp (B, T), d/dhidden, d/dweight, d/dbias."""
    h = hidden.detach().float().requires_grad_(True)
    w = weight.detach().float().requires_grad_(True)
    b = None if bias is None else bias.detach().float().requires_grad_(True)
    logits = h @ w.T + (0.0 if b is None else b)
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(targets >= 0, logp, torch.zeros_like(logp))
    (logp * upstream).sum().backward()
    return logp.detach(), h.grad, w.grad, None if b is None else b.grad


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [3, 1000])  # 3: four chunks of the 10 positions; 1000: one chunk
def test_halfmm_matches_fp32_reference(temperature, bias, chunk):
    hidden, head, targets = _bf16_inputs(seed=3, bias=bias)
    upstream = torch.randn(B, T, generator=torch.Generator().manual_seed(4))  # arbitrary dL/dlogp
    ref_logp, ref_h, ref_w, ref_b = _fp32_autograd(hidden, head.weight, head.bias, targets, temperature, upstream)

    h = hidden.clone().requires_grad_(True)
    logp, ent = token_logprobs(h, head, targets, temperature, chunk_tokens=chunk, return_entropy=True, impl="halfmm")
    (logp * upstream).sum().backward()
    assert logp.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    assert head.weight.grad.dtype == torch.bfloat16
    # forward: products of bf16 values are exact in fp32, so only the order of summation differs
    assert (logp - ref_logp).abs().max().item() < 1e-5
    assert (logp[1, 3:] == 0).all() and (h.grad[1, 3:] == 0).all()
    # the chunked fp32 path on the same bf16 values, upcast
    head32 = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head32.weight.copy_(head.weight.float())
        if bias:
            head32.bias.copy_(head.bias.float())
    chunked, chunked_ent = token_logprobs(hidden.float(), head32, targets, temperature, chunk_tokens=chunk,
                                          return_entropy=True)
    assert (logp - chunked).abs().max().item() < 1e-5
    assert (ent - chunked_ent).abs().max().item() < 1e-5
    # backward: the softmax gradient and the two matmul results are rounded to bf16 (2**-8 relative)
    assert _rel(h.grad, ref_h) < 2e-2
    assert _rel(head.weight.grad, ref_w) < 2e-2
    if bias:
        assert _rel(head.bias.grad, ref_b) < 2e-2


def test_halfmm_fp32_hidden_and_tensor_head():
    """fp32 hidden states are cast to the head's dtype (the gradient reaches them as fp32); a weight
    tensor works as the head."""
    hidden, head, targets = _bf16_inputs(seed=5, bias=False)
    hidden32 = hidden.float().requires_grad_(True)  # bf16 values held in fp32: the cast is exact
    weight = head.weight.detach().clone().requires_grad_(True)
    logp = token_logprobs(hidden32, weight, targets, TEMP, chunk_tokens=4, impl="halfmm")
    upstream = torch.ones(B, T)
    logp.sum().backward()
    ref_logp, ref_h, ref_w, _ = _fp32_autograd(hidden, weight.detach(), None, targets, TEMP, upstream)
    assert (logp - ref_logp).abs().max().item() < 1e-5
    assert hidden32.grad.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    assert _rel(hidden32.grad, ref_h) < 2e-2 and _rel(weight.grad, ref_w) < 2e-2


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_halfmm_entropy_and_logprob_by_hand(temperature):
    # W rows (1, 0), (0, 0) x 3; position 0: h = (0, 1) -> logits (0, 0, 0, 0): uniform, H = ln 4,
    # logp = -ln 4; position 1: h = (2, 0) -> z = (2, 0, 0, 0) / T = (a, 0, 0, 0), a = 2 / T:
    # lse = ln(e^a + 3), H = lse - a e^a / (e^a + 3), logp(token 0) = a - lse, logp(token 1) = -lse.
    weight = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.bfloat16)
    hidden = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [2.0, 0.0]]], dtype=torch.bfloat16)
    targets = torch.tensor([[2, 0, 1]])
    logp, ent = token_logprobs(hidden, weight, targets, temperature, chunk_tokens=2, return_entropy=True,
                               impl="halfmm")
    a = 2.0 / temperature
    lse = math.log(math.exp(a) + 3)
    h1 = lse - a * math.exp(a) / (math.exp(a) + 3)
    torch.testing.assert_close(logp, torch.tensor([[-math.log(4), a - lse, -lse]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, torch.tensor([[math.log(4), h1, h1]]), atol=1e-6, rtol=0)
    assert not ent.requires_grad


def test_halfmm_resolution_and_errors():
    head = torch.nn.Linear(8, 32).to(torch.bfloat16)  # with a bias, on the CPU: halfmm still runs
    assert head_impl("halfmm", head, 0.7) == ("halfmm", "asked for")
    assert head_impl("halfmm", head.weight, 1.0) == ("halfmm", "asked for")
    assert head_impl("auto", head.half(), 1.0)[0] == "chunked"  # auto does not pick it (off CUDA, and not yet)
    with pytest.raises(ValueError, match=r"--learner_head halfmm cannot run: the head is torch.float32"):
        head_impl("halfmm", torch.nn.Linear(8, 32), 1.0)
    with pytest.raises(ValueError, match="--learner_head halfmm cannot run: the head is not an nn.Linear"):
        head_impl("halfmm", torch.nn.Sequential(head), 1.0)
    hidden, head32, targets = _inputs()
    with pytest.raises(ValueError, match="halfmm.*torch.float32"):
        token_logprobs(hidden, head32, targets, TEMP, impl="halfmm")
