"""CUDA kernels of the continuous sampler's decode step: attention that reads only each
slot's own positions, and the token pick in one pass over the logits.

Why: the portable step's masked attention (:func:`distrl.rollout.engines.hf.decode.grouped_attention`) reads every
position of every slot, however short the slot's row, and its pick (:func:`distrl.rollout.engines.hf.decode.pick`:
an Exp(1) draw written over the (B, V) fp32 logits, then an argmax pass and a logsumexp pass) reads the logits
several times; at many slots these two were a large share of a step (timings: BENCHMARKS.md).

- :func:`slot_attention`: slot b attends to its positions 0 .. lengths[b] - 1 only. By default a split-K Triton
  kernel (:func:`decode_attention`: several programs per (slot, K/V head), each over a share of the positions,
  then a pass that combines them), for
  head sizes that are a power of 2 of at least 16; else, or with ``impl="flash"``, FlashAttention's
  variable-length kernel as torch ships it (``aten._flash_attention_forward`` with ``seqused_k``, each K/V head's
  G query heads as G query rows). The slots' K/V live in one (B, L, Hkv, D) buffer, so slot b's keys are rows
  b * L .. b * L + L - 1 of its (B * L, Hkv, D) view: a view, no copy.
- :func:`sample_rows`: one Triton program per row reads its logits once and keeps, per lane, the running max
  and sum of exp (the logsumexp, online) and the best key so far: the logit itself (greedy, T = 0) or
  ``logit / T + G`` with G = -log(-log U) Gumbel noise from Philox (``tl.rand4x``), keyed by the step's seed and
  the row: the Gumbel-max trick, an exact draw from softmax(logits / T) (Gumbel 1954; the exponential race of
  ``pick`` is the same draw). Ties go to the lowest index, as ``torch.argmax``.

Both are CUDA-only (:func:`available`); the sampler keeps the portable path elsewhere (CPU, fp32 models).
"""

from __future__ import annotations

import functools

import torch

try:  # CUDA images ship triton with torch; the CPU wheels do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing (CPU CI)
    triton = None

ROW_SEED_SHIFT = 24  # a row's Philox seed: step seed * 2**24 + row (rows < 16M)


def available(model) -> bool:
    """Whether the decode step can use these kernels: a CUDA model in bf16 or fp16 with head dim <= 256 (a
    multiple of 8), triton importable, and FlashAttention in this torch (the attention of head sizes the Triton
    kernel does not take)."""
    if triton is None or model.device.type != "cuda" or model.dtype not in (torch.bfloat16, torch.float16):
        return False
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return head_dim <= 256 and head_dim % 8 == 0 and torch.backends.cuda.is_flash_attention_available()


ATTENTION_IMPLS = ("flash", "triton")  # slot_attention's kernels


def slot_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                   scale: float, impl: str = "triton") -> torch.Tensor:
    """Decode attention of n slots, each over its own first ``lengths[b]`` positions: the split-K Triton kernel
    (``impl="triton"``, :func:`decode_attention`, for head sizes :func:`triton_head_dim` takes; FlashAttention
    for the others) or FlashAttention varlen (``"flash"``). The Triton kernel is the default: FlashAttention runs one
    128-row tile per (slot, head) and is bound by each block's latency, which splitting the positions hides.

    Args:
        query: (n, H, 1, D), the step's one query per slot.
        key, value: (n, Hkv, L, D) views of the slots' (n, L, Hkv, D) K/V buffers (``SlotLayer`` returns them
            so); H = G * Hkv, query head h uses K/V head h // G.
        lengths: (n,) int32, 1 <= lengths[b] <= L: the positions slot b attends to (0 .. lengths[b] - 1).
        scale: the score scale.
    Returns:
        (n, 1, H, D) in the query's dtype (the layout transformers' attention functions return).
    Raises:
        RuntimeError: from FlashAttention for inputs it does not take (e.g. fp32, CPU tensors).
        ValueError: an unknown ``impl``.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown decode attention {impl!r}; expected one of {ATTENTION_IMPLS}")
    if impl == "triton" and triton_head_dim(query.shape[-1]):
        return decode_attention(query, key, value, lengths, scale)
    n, hkv, length, d = key.shape
    h = query.shape[1]
    g = h // hkv
    k = key.transpose(1, 2).reshape(n * length, hkv, d)  # the buffer's own layout: a view
    v = value.transpose(1, 2).reshape(n * length, hkv, d)
    # a group's G query heads become G query rows of one K/V head (FlashAttention's own GQA decode trick): each
    # (slot, K/V head) block reads its K/V once, not once per query head
    q = query[:, :, 0].reshape(n, hkv, g, d).transpose(1, 2).reshape(n * g, hkv, d)
    slots = torch.arange(n + 1, dtype=torch.int32, device=query.device)
    # the op under torch.nn.attention.varlen.varlen_attn, whose torch 2.11 signature lacks seqused_k
    out = torch.ops.aten._flash_attention_forward(q, k, v, slots * g, slots * length, g, length, 0.0, False, False,
                                                  scale=scale, seqused_k=lengths)[0]  # (n * G, Hkv, D)
    return out.view(n, g, hkv, d).transpose(1, 2).reshape(n, 1, h, d)  # (n, Hkv, G, D) -> head j * G + i


DECODE_BLOCK_N = 64  # positions a block of decode_attention reads at a time


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(n: int, hkv: int, length: int, device: torch.device, block_n: int = DECODE_BLOCK_N,
                  programs_per_sm: int = 2) -> int:
    """Splits of each slot's positions in :func:`decode_attention`: enough (slot, head, split) programs for
    ``programs_per_sm`` per multiprocessor, at most one per block of ``block_n`` positions (1 for 1024 slots x 2
    heads; 5 for 8 slots x 320 positions)."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    return max(1, min(-(-length // block_n), -(-programs_per_sm * sms // (n * hkv))))


def triton_head_dim(d: int) -> bool:
    """Whether :func:`decode_attention` takes head size ``d``: a power of 2 (``tl.arange``), at least 16
    (``tl.dot``). Others (e.g. 80, 96) go through FlashAttention."""
    return d >= 16 and d & (d - 1) == 0


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Decode attention of n slots over their own first ``lengths[b]`` positions, in Triton: a program per (slot,
    K/V head, split of the positions) holds the head's G query heads as rows of one tile and runs an online
    softmax over blocks of ``DECODE_BLOCK_N`` positions; with several splits a second kernel combines them (split-K,
    "flash decoding", Dao et al. 2023). Same arguments and result as :func:`slot_attention` (D a power of 2).

    Raises:
        RuntimeError: without triton.
        ValueError: a head size :func:`triton_head_dim` rejects.
    """
    if not triton_head_dim(query.shape[-1]):
        raise ValueError(f"decode_attention takes head sizes that are a power of 2 >= 16, not {query.shape[-1]}")
    if triton is None:
        raise RuntimeError("decode_attention needs triton (a CUDA build of torch)")
    n, h = query.shape[0], query.shape[1]
    out = _decode_attention(query[:, :, 0], key, value, lengths, scale)
    return out.view(n, 1, h, query.shape[-1])


if triton is not None:

    @triton.jit
    def _decode_split(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, part_ptr, ml_ptr, chunk, scale,
                      sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, so_b, so_h,
                      HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
        """Program (slot b, K/V head j, split s): the G query heads of head j against positions
        [s * chunk, min((s + 1) * chunk, lengths[b])), an online softmax over blocks of BLOCK_N positions. One
        split writes the normalized output; several write their unnormalized sums and (max, sum of exp) for
        :func:`_decode_combine`."""
        b, j, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows, dims = tl.arange(0, G_PAD), tl.arange(0, D)
        heads = j * G + rows
        q = tl.load(q_ptr + b.to(tl.int64) * sq_b + heads[:, None] * sq_h + dims[None, :],
                    mask=(rows < G)[:, None], other=0.0)
        start = s * chunk
        end = tl.minimum(start + chunk, tl.load(len_ptr + b))
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        k_base = k_ptr + b.to(tl.int64) * sk_b + j * sk_h
        v_base = v_ptr + b.to(tl.int64) * sv_b + j * sv_h
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            inside = pos < end
            k = tl.load(k_base + pos[:, None] * sk_l + dims[None, :], mask=inside[:, None], other=0.0)
            scores = tl.where(inside[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))  # (G_PAD, BLOCK_N)
            m_new = tl.maximum(m, tl.max(scores, 1))  # finite: a block holds at least one position
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + pos[:, None] * sv_l + dims[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if SPLITS == 1:
            out = acc / total[:, None]
            tl.store(out_ptr + b.to(tl.int64) * so_b + heads[:, None] * so_h + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=(rows < G)[:, None])
        else:
            at = ((b.to(tl.int64) * HKV + j) * SPLITS + s) * G_PAD + rows  # (G_PAD,) rows of this split
            tl.store(part_ptr + at[:, None] * D + dims[None, :], acc)
            tl.store(ml_ptr + at * 2, m)
            tl.store(ml_ptr + at * 2 + 1, total)

    @triton.jit
    def _decode_combine(out_ptr, part_ptr, ml_ptr, so_b, so_h, HKV: tl.constexpr, G: tl.constexpr,
                        G_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        """Program (slot b, K/V head j): the splits' sums rescaled to their common max, then normalized."""
        b, j = tl.program_id(0), tl.program_id(1)
        rows, dims = tl.arange(0, G_PAD), tl.arange(0, D)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for s in range(SPLITS):
            at = ((b.to(tl.int64) * HKV + j) * SPLITS + s) * G_PAD + rows
            m_s = tl.load(ml_ptr + at * 2)
            m_new = tl.maximum(m, m_s)  # finite from split 0 on: it holds position 0
            a_old = tl.where(m > float("-inf"), tl.exp(m - m_new), 0.0)
            a_s = tl.where(m_s > float("-inf"), tl.exp(m_s - m_new), 0.0)  # an empty split adds nothing
            total = total * a_old + tl.load(ml_ptr + at * 2 + 1) * a_s
            acc = acc * a_old[:, None] + tl.load(part_ptr + at[:, None] * D + dims[None, :]) * a_s[:, None]
            m = m_new
        heads = j * G + rows
        tl.store(out_ptr + b.to(tl.int64) * so_b + heads[:, None] * so_h + dims[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=(rows < G)[:, None])

    @torch.library.custom_op("distrl::decode_attention", mutates_args=())
    def _decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                          scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        launch_decode_attention(query, key, value, lengths, scale, out)
        return out

    @_decode_attention.register_fake
    def _(query, key, value, lengths, scale):
        return torch.empty_like(query)

    @triton.jit
    def _race(base, c, vocab, inv, u, sampling, m, s, best, best_col, best_x):
        """Columns ``c`` of a row (logits at ``base``, scaled by ``inv`` = 1 / T): the online logsumexp (one exp an
        entry: e = exp(-|x - m|) either rescales the sum to a new maximum or adds x's term) and the Gumbel-max race
        (see the module docstring). ``m`` starts at a finite floor, so masked entries (x = -inf) add exp(-inf) = 0."""
        x = tl.load(base + c, mask=c < vocab, other=float("-inf")) * inv
        e = tl.exp(-tl.abs(x - m))
        s = tl.where(x > m, s * e + 1.0, s + e)
        m = tl.maximum(m, x)
        key = x + tl.where(sampling, -tl.log(-tl.log(u)), 0.0)
        better = key > best
        return (m, s, tl.where(better, key, best), tl.where(better, c, best_col), tl.where(better, x, best_x))

    @triton.jit
    def _sample_kernel(logits_ptr, stride, vocab, temperature_ptr, seed_ptr, tok_ptr, logp_ptr,
                       BLOCK: tl.constexpr, SHIFT: tl.constexpr):
        row = tl.program_id(0)
        temperature = tl.load(temperature_ptr)
        sampling = temperature > 0
        inv = 1.0 / tl.where(sampling, temperature, 1.0)
        seed = tl.load(seed_ptr) * (1 << SHIFT) + row
        base = logits_ptr + row.to(tl.int64) * stride
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -1.0e30, tl.float32)  # below any logit; a lane that sees none keeps s = 0
        s = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = tl.zeros([BLOCK], tl.int32)
        best_x = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, 4 * BLOCK):
            u0, u1, u2, u3 = tl.rand4x(seed, start + lanes)  # one Philox call: four uniforms per lane
            m, s, best, best_col, best_x = _race(base, start + lanes, vocab, inv, u0, sampling, m, s, best,
                                                 best_col, best_x)
            m, s, best, best_col, best_x = _race(base, start + BLOCK + lanes, vocab, inv, u1, sampling, m, s, best,
                                                 best_col, best_x)
            m, s, best, best_col, best_x = _race(base, start + 2 * BLOCK + lanes, vocab, inv, u2, sampling, m, s,
                                                 best, best_col, best_x)
            m, s, best, best_col, best_x = _race(base, start + 3 * BLOCK + lanes, vocab, inv, u3, sampling, m, s,
                                                 best, best_col, best_x)
        top = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - top), 0)
        win = tl.max(best, 0)
        col = tl.min(tl.where(best == win, best_col, vocab), 0)
        x_win = tl.max(tl.where((best == win) & (best_col == col), best_x, float("-inf")), 0)
        tl.store(tok_ptr + row, col.to(tl.int64))
        tl.store(logp_ptr + row, x_win - (top + tl.log(total)))

    @torch.library.custom_op("distrl::sample_rows", mutates_args=())
    def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor,
                     seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, vocab = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        tok = torch.empty(b, dtype=torch.long, device=logits.device)
        logp = torch.empty(b, dtype=torch.float32, device=logits.device)
        launch_sample_rows(logits, temperature, seed, tok, logp)
        return tok, logp

    @_sample_rows.register_fake
    def _(logits, temperature, seed):
        b = logits.shape[0]
        return logits.new_empty(b, dtype=torch.long), logits.new_empty(b, dtype=torch.float32)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor,
                seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob, in one pass over the logits (see the module docstring).

    Args:
        logits: (B, V) fp32, rows contiguous, on CUDA.
        temperature: () or (1,) fp32 on the same device: 0 picks the argmax (logprob under softmax(logits));
            T > 0 draws from softmax(logits / T) (logprob under it).
        seed: (1,) int64 on the same device, 0 <= seed < 2**39: the step's Philox seed; calls with the same seed
            and rows draw the same noise, so the caller advances it every step (inside a CUDA graph too).
    Returns:
        tokens (B,) long and logprobs (B,) fp32, as :func:`distrl.rollout.engines.hf.decode.pick` returns them.
    Raises:
        RuntimeError: without triton (:func:`available`).
    """
    if triton is None:
        raise RuntimeError("sample_rows needs triton (a CUDA build of torch)")
    return _sample_rows(logits, temperature, seed)


def launch_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                            scale: float, out: torch.Tensor, block_n: int = DECODE_BLOCK_N, warps: int = 2,
                            stages: int | None = 3, programs_per_sm: int = 2) -> None:
    """The kernels of :func:`decode_attention` with their launch settings (``bench/decode_kernels.py`` sweeps
    them): ``query`` (n, H, D), ``out`` the same shape, written; ``block_n`` positions a block reads at a time,
    ``warps`` and ``stages`` (software pipelining; None: triton's default) of the split kernel,
    ``programs_per_sm`` the split target of :func:`decode_splits`. The defaults are the sweep's fastest (its
    figures: BENCHMARKS.md)."""
    n, heads, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    if n == 0:
        return
    g = heads // hkv
    splits = decode_splits(n, hkv, length, query.device, block_n, programs_per_sm)
    per_split = -(-length // splits)
    chunk = -(-per_split // block_n) * block_n  # positions a split: whole blocks
    g_pad = max(16, triton.next_power_of_2(g))
    part = query.new_empty((n, hkv, splits, g_pad, d), dtype=torch.float32) if splits > 1 else out
    ml = query.new_empty((n, hkv, splits, g_pad, 2), dtype=torch.float32) if splits > 1 else out
    extra = {} if stages is None else {"num_stages": stages}
    _decode_split[(n, hkv, splits)](query, key, value, lengths, out, part, ml, chunk, scale,
                                    query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                                    key.stride(2), value.stride(0), value.stride(1), value.stride(2),
                                    out.stride(0), out.stride(1), HKV=hkv, G=g, G_PAD=g_pad, D=d,
                                    BLOCK_N=block_n, SPLITS=splits, num_warps=warps, **extra)
    if splits > 1:
        _decode_combine[(n, hkv)](out, part, ml, out.stride(0), out.stride(1), HKV=hkv, G=g, G_PAD=g_pad, D=d,
                                  SPLITS=splits, num_warps=4)


def launch_sample_rows(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, tok: torch.Tensor,
                       logp: torch.Tensor, block: int = 512, warps: int = 16) -> None:
    """The kernel of :func:`sample_rows` with its launch settings (``bench/decode_kernels.py`` sweeps them):
    writes ``tok`` (B,) long and ``logp`` (B,) fp32; ``logits`` (B, V) with contiguous rows; ``block`` lanes of a
    program (each takes 4 * ``block`` columns an iteration), ``warps`` its warps. The defaults are the sweep's
    fastest (its figures: BENCHMARKS.md)."""
    if logits.shape[0]:
        _sample_kernel[(logits.shape[0],)](logits, logits.stride(0), logits.shape[1], temperature, seed, tok, logp,
                                           BLOCK=block, SHIFT=ROW_SEED_SHIFT, num_warps=warps)
