"""Continuous batching for the HF engine: B row slots over a KV cache where each slot has its own write
position; a row that ends (stop token or budget) frees its slot, and a waiting row takes it while the
other rows go on decoding.

Layout. The cache holds B slots x L positions per layer (L = longest prompt + most new tokens, each
rounded up to ``PAD_MULTIPLE``). A prompt placed in slot b fills positions 0..P-1 of that slot (its
token positions are its cache positions: no padding inside a row) and its t-th new token goes to
position P + t - 1. A (B, L) bool ``valid`` marks the positions holding the slot's current row (always
0 .. its position); attention reads every position and masks the others
(:func:`distrl.rollout.engines.hf.decode.grouped_attention`), or, on CUDA with the decode kernels
(:mod:`distrl.rollout.engines.hf.kernels`), reads only the slot's own positions.

Loop (:meth:`ContinuousSampler.run`):

1. Admit: waiting rows take the free slots (``continuous``: whenever a slot is free; ``static``: only
   when every slot is free, so each batch runs to its longest row: the reference the bench compares
   with). The admitted prompts are prefilled together (right-padded to the longest, causal attention), their
   K/V written into their slots, and each row's first token picked from the logits at its last prompt
   position. Rows of the same prompt (a group's completions) share one prefill: its K/V are copied into
   the others' slots, and each row draws its own first token from the shared logits. Their ids, lengths,
   slots and budgets reach the GPU in one pinned, non-blocking copy: the host queues the admission behind
   the queued steps without waiting for them.
2. Decode: one step for all B slots, as the fast path's (fp32 head, argmax or the exponential race over
   ``logits / T`` and the logprob under ``softmax(logits / T)``: :func:`.decode.pick`, or the
   same in one pass with Gumbel noise where the kernels run: :func:`.kernels.sample_rows`), each
   token and logprob recorded at its row's own column (the row's length so far). Free slots decode padding,
   masked out of every output. Every write of the step (K/V at each slot's position, token, logprob) is an
   ``index_put_``, which torch.compile keeps in place (a ``scatter_`` into the cache made inductor copy the
   whole cache).
   On CUDA the step is captured once in a graph (and optionally compiled, once for every slot count), as in
   :mod:`distrl.rollout.engines.hf.static`; admitting rows copies into the same buffers, so the graph stays valid.
3. Every ``interval`` tokens (counted from the call's start, as the engine's loop counts them): a snapshot
   of the slots' outputs is copied to the host (non-blocking, an event behind it); the rows it shows ended
   are handed back (yielded) and their slots freed; then ``between_steps`` runs (an in-flight load) and
   waiting rows are admitted. A row therefore waits at most ``interval - 1`` steps after its end before it
   is handed back and its slot refilled.

   Look-ahead: unless ``between_steps`` is given, the snapshot of an interval is read only after the next
   interval's steps are queued, so the host's work of a hand-back (and the caller's: the actor scores and
   PUTs the groups it yields) and of the admission's eager prefill runs while the GPU decodes, instead of
   between the GPU's steps (an admission takes a few steps' time). A row ended
   in interval i is then handed back after interval i + 1 (its slot decodes padding meanwhile, masked as
   every ended row's). A slot's snapshot counts only from the interval its current row was admitted in.
   An interval at whose end every running row has reached its budget is read at once (no interval of
   padding after the last), and so is the older snapshot before the tail moves rows (step 4: its slots are
   those before the move). With ``between_steps`` the hand-back stays synchronous, so each row's stamps
   are the versions of its first and last tokens; so does static batching's (the reference: each batch to
   its longest row, no interval more).

4. The tail: once no row waits (and not static), the step decodes only the smallest of :func:`buckets`
   (B, B/4, B/16, ... down to ``MIN_BUCKET``) that holds the rows still running; rows in slots at or past it
   move below it first (their K/V in every layer and their per-slot buffers, copied on the device). A call's
   last rows then no longer pay for B slots a step (with completion lengths that vary, a large share of a
   call's steps run with a few rows left). Each bucket is one more captured graph, all made at
   the end of a state's first call (``_capture_buckets``); the compiled step is shared (its slot count is a
   symbolic size: :func:`distrl.rollout.engines.hf.decode.compiled_step`).

Exactness: a row's tokens and logprobs depend only on its prompt and the weights (masked positions
weigh exactly 0), so greedy rows equal the engine's own loop's (``tests/integration/test_continuous.py``:
logprobs within 1e-5 in fp32). Each row is handed back with the ``stamp()`` (the engine's policy version)
read when it was admitted and when it was handed back: loads happen only at step 3, after the rows that
ended are handed back, so these are the versions of its first and of its last token.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

import torch

from distrl.rollout.engines.hf.decode import (
    ATTENTION,
    PAD_MULTIPLE,
    compiled_step,
    grouped_attention,
    grouped_attention_mode,
    has_mm_out_dtype,
    head_logits,
    pick,
    round_up,
    step_graph,
    supports_static,
)
from distrl.rollout.engines.hf.kernels import ATTENTION_IMPLS, sample_rows
from distrl.rollout.engines.hf.kernels import available as kernels_available
from distrl.rollout.engines.hf.slots import Finished, SlotState, Snapshot, buckets, copy_prefix, move_rows

STATES = 2  # slot states kept at once (ContinuousSampler._prepare)
PREFILL_ATTENTION = ("causal", "masked")  # ContinuousSampler's prefill_attention


class ContinuousSampler:
    """Samples rows in ``slots`` slots, refilled as rows end (see the module docstring).

    Args: as :class:`distrl.rollout.engines.hf.static.StaticSampler` (model_fn, pad_id, stop_ids, generator,
    cuda_graphs, interval, compile_step, compile_dynamic), and ``kernels``: the decode step's CUDA kernels
    (:mod:`.kernels`: attention over each slot's own positions, the pick in one pass over
    the logits); None (default) uses them where :func:`.kernels.available`. The step's noise then
    comes from Philox seeded from ``generator`` once per state, not from ``generator`` every step.
    ``decode_attention``: the kernels' attention (:func:`.kernels.slot_attention`), ``triton`` (the default:
    split-K) or ``flash``.
    ``prefill_attention``: ``causal`` (default: torch's SDPA with ``is_causal``, FlashAttention on CUDA, no (k, H, Q, Q)
    scores held) or ``masked`` (:func:`.decode.grouped_attention` with a (k, 1, Q, Q) bool mask: the
    reference ``bench.variable_length`` compares with). ``lookahead``: read each interval's snapshot after the next
    interval's steps are queued (step 3 of the module docstring; default); False: read it at once (the reference).
    Raises ValueError for cuda_graphs off CUDA, ``kernels`` where they are not available, an unknown attention, or a
    model with sliding-window layers.
    """

    def __init__(self, model_fn: Callable, pad_id: int, stop_ids: torch.Tensor, generator: torch.Generator,
                 cuda_graphs: bool, interval: int = 8, compile_step: bool = False, compile_dynamic: bool = True,
                 kernels: bool | None = None, decode_attention: str = "triton", prefill_attention: str = "causal",
                 lookahead: bool = True):
        from transformers import AttentionInterface

        model = model_fn()
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA model, not one on {model.device}")
        if not supports_static(model.config):
            raise ValueError("continuous batching supports full-attention models only (sliding window found)")
        can = kernels_available(model)
        if kernels and not can:
            raise ValueError(f"the decode kernels need a bf16/fp16 CUDA model, triton and FlashAttention "
                             f"({model.device}, {model.dtype})")
        self.kernels = can if kernels is None else kernels
        if decode_attention not in ATTENTION_IMPLS:
            raise ValueError(f"unknown decode_attention {decode_attention!r}; one of {ATTENTION_IMPLS}")
        self.decode_attention = decode_attention
        if prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"unknown prefill_attention {prefill_attention!r}; one of {PREFILL_ATTENTION}")
        self.prefill_causal = prefill_attention == "causal"
        AttentionInterface.register(ATTENTION, grouped_attention)
        self.model_fn, self.pad_id, self.stop_ids, self.generator = model_fn, pad_id, stop_ids, generator
        self.cuda_graphs, self.interval, self.lookahead = cuda_graphs, interval, lookahead
        self.captures = 0
        self._states: dict[int, SlotState] = {}  # slot count -> its state (see _prepare)
        self.kv_slots: int | None = None  # every state's K/V slots, once reserved (reserve)
        self.states_made = 0  # states allocated so far (each new graph captures on CUDA)
        self._mm_fp32 = model.device.type == "cuda" and has_mm_out_dtype(model.device)
        self._decode_fn = compiled_step(self._decode, compile_step, compile_dynamic)
        self.compile_dynamic = compile_step and compile_dynamic

    def reset(self) -> None:
        """Drop the captured graphs; call after the model's modules (not only their values) changed."""
        for st in self._states.values():
            st.graphs.clear()

    @torch.inference_mode()  # torch enters it around each resumption of the generator, not across its yields
    def run(self, rows: list[list[int]], budget: list[int], temperature: float, slots: int | None = None,
            static: bool = False, between_steps=None, stamp: Callable[[], int] = lambda: 0) -> Iterator[list[Finished]]:
        """Sample every row to its stop token or budget, yielding the rows that ended at each hand-back.

        Args:
            rows: R prompt id lists (each non-empty). budget: R most-new-token counts.
            temperature: 0 is greedy; > 0 samples from softmax(logits / T).
            slots: rows decoded at once (default: all R). static: admit only when every slot is free.
            between_steps: called every ``interval`` tokens while rows run (may load weights in place).
            stamp: read at each row's admission and hand-back (the engine's policy version).
        Yields:
            lists of :class:`Finished`, each row exactly once.
        """
        model = self.model_fn()
        b = min(slots or len(rows), len(rows))
        st = self._prepare(model, b, round_up(max(map(len, rows)), PAD_MULTIPLE) +
                           round_up(max(budget), PAD_MULTIPLE), round_up(max(budget), PAD_MULTIPLE))
        st.temperature.fill_(temperature)
        waiting, owner, started = deque(range(len(rows))), [-1] * b, [0] * len(rows)
        admitted = [0] * b  # the interval each slot's current row was admitted in
        ends = [0] * b  # the token count (t) at which each slot's current row reaches its budget
        st.done.fill_(True)
        t, k, pending, n = 1, 0, None, b  # tokens recorded by the first rows (as the loop counts), interval, slots run
        while True:
            k += 1
            free = [s for s, o in enumerate(owner) if o < 0][: len(waiting)]
            if free and (not static or all(o < 0 for o in owner)):
                taken = [waiting.popleft() for _ in free]
                for s, r in zip(free, taken):
                    owner[s], started[r], admitted[s], ends[s] = r, stamp(), k, t + budget[r] - 1
                with grouped_attention_mode(model):
                    self._admit(model, st, free, [rows[r] for r in taken], [budget[r] for r in taken])
            if all(o < 0 for o in owner):
                if self.cuda_graphs:
                    self._capture_buckets(model, st)
                return
            with grouped_attention_mode(model):
                while True:
                    self._step(model, st, n)
                    t += 1
                    if t % self.interval == 0:
                        break
            snaps = [pending, st.snapshot(k)]
            ahead = self.lookahead and between_steps is None and not static and (
                waiting or max(ends[s] for s, o in enumerate(owner) if o >= 0) > t)  # a row may still run
            pending = snaps.pop() if ahead else None
            for snap in filter(None, snaps):  # oldest first: each its own hand-back
                finished = self._hand_back(snap, owner, started, admitted, stamp())
                if finished:
                    yield finished
            if between_steps is not None and (waiting or any(o >= 0 for o in owner)):
                between_steps()
            if not waiting and not static:  # the tail: decode only as many slots as rows still run
                if pending is not None and self._shrink_target(owner) < n:  # rows move: read the older look first
                    finished, pending = self._hand_back(pending, owner, started, admitted, stamp()), None
                    if finished:
                        yield finished
                n = self._shrink(st, owner, admitted, ends, n)

    @staticmethod
    def _shrink_target(owner: list[int]) -> int:
        """The smallest bucket (:func:`buckets`) that holds the rows still running."""
        live = sum(o >= 0 for o in owner)
        return min(m for m in buckets(len(owner)) if m >= live)

    def _shrink(self, st: SlotState, owner: list[int], admitted: list[int], ends: list[int], n: int) -> int:
        """With no row waiting: the smallest bucket (:meth:`_shrink_target`) that holds the running rows, which
        move to free slots below it (:func:`distrl.rollout.engines.hf.slots.move_rows`); the step then decodes only
        those slots (a graph per bucket). The running rows' tokens and logprobs are unchanged: a row depends only
        on its own prompt, positions and K/V, all moved with it."""
        target = self._shrink_target(owner)
        if target >= n:
            return n
        src = [s for s, o in enumerate(owner) if o >= 0 and s >= target]
        dst = [s for s in range(target) if owner[s] < 0][: len(src)]
        if src:
            move_rows(st, src, dst)
            for s, d in zip(src, dst):
                owner[d], admitted[d], ends[d], owner[s] = owner[s], admitted[s], ends[s], -1
        return target

    def _capture_buckets(self, model, st: SlotState) -> None:
        """Capture the step of every bucket (:func:`buckets`) not captured yet, at the end of a call, when every
        slot is free: a free slot's step writes only what admission resets (its valid row, outputs, position)
        and K/V at positions masked until rewritten. A later call's tail then replays graphs only: no capture
        after a state's first call."""
        with grouped_attention_mode(model):
            for n in buckets(st.tok.shape[0]):
                if n not in st.graphs:
                    self._step(model, st, n)

    def _hand_back(self, snap: "Snapshot", owner: list[int], started: list[int], admitted: list[int],
                   version: int) -> list[Finished]:
        """The rows that ``snap`` shows done (admitted no later than its interval), their slots freed."""
        if snap.event is not None:
            snap.event.synchronize()
        done = snap.done.tolist()
        slots = [s for s, o in enumerate(owner) if o >= 0 and done[s] and admitted[s] <= snap.interval]
        if not slots:
            return []
        index = torch.tensor(slots)
        lengths, stopped = snap.lengths[index].tolist(), snap.stopped[index].tolist()
        tokens, logps = snap.tokens[index].tolist(), snap.logps[index].tolist()
        out = []
        for i, s in enumerate(slots):
            n, r = lengths[i], owner[s]
            out.append(Finished(r, tokens[i][:n], logps[i][:n], stopped[i], (started[r], version)))
            owner[s] = -1
        return out

    # -- buffers, admission, one step ---------------------------------------------------------

    def reserve(self, slots: int) -> None:
        """Give every state's K/V ``slots`` slots (at least; the most rows a call decodes at once), so that the
        compiled step sees the K/V's slot count as a constant (:meth:`SlotState.mark_dynamic`): call it before the
        first call compiles. A later call of more rows raises the reservation to its own and drops the states
        made before: the step is then traced again once, with that size symbolic from then on. Raises ValueError
        for ``slots`` < 1."""
        if slots < 1:
            raise ValueError(f"reserve needs at least one slot, got {slots}")
        if self.kv_slots is None or slots > self.kv_slots:
            self.kv_slots = slots
            self._states.clear()

    def _prepare(self, model, b: int, length: int, s: int) -> SlotState:
        """The state for B slots of at least ``length`` positions and S output columns.

        One state per slot count (at most :data:`STATES`, the least recently used dropped first: e.g. the
        training calls' and the evaluations'), reused while it is large enough: positions past a row's own
        are masked and columns past its budget unused, so a longer state gives the same rows. A call that
        needs more grows it to the larger of both sizes, so a run's varying prompt lengths cost a new state
        (new buffers and graph captures; no compilation) only when the longest so far grows.
        """
        if self.kv_slots is not None and b > self.kv_slots:
            self.reserve(b)
        st = self._states.pop(b, None)
        if st is not None and st.valid.shape[1] >= length and st.tokens.shape[1] >= s + 1:
            self._states[b] = st  # most recently used last
            return st
        if st is not None:  # too small: free its buffers and graphs before the larger one is made
            length, s = max(length, st.valid.shape[1]), max(s, st.tokens.shape[1] - 1)
            del st
        while len(self._states) >= STATES:
            self._states.pop(next(iter(self._states)))
        st = SlotState.empty(model, b, length, s, self.generator if self.kernels else None, self.kv_slots)
        self._states[b] = st
        self.states_made += 1
        return st

    def _admit(self, model, st: SlotState, slots: list[int], rows: list[list[int]], budget: list[int]) -> None:
        """Prefill ``rows`` into ``slots`` (right-padded, causal) and record each row's first token. Rows of the
        same prompt (a group's) are prefilled once: the others' K/V are copied from its slot
        (:func:`distrl.rollout.engines.hf.slots.copy_prefix`) and their first tokens drawn from its logits."""
        dev = st.tok.device
        k, q = len(rows), max(map(len, rows))
        first: dict[tuple, int] = {}  # prompt -> the row that prefills it
        source = [first.setdefault(tuple(r), i) for i, r in enumerate(rows)]
        inverse = {i: n for n, i in enumerate(first.values())}
        u = len(first)
        host = torch.full((k, q + 5), self.pad_id, dtype=torch.long)  # ids | length | slot | budget | maps, one copy
        for i, r in enumerate(rows):
            host[i, : len(r)] = torch.tensor(r)
        host[:, q:q + 3] = torch.tensor([[len(r), s, n] for r, s, n in zip(rows, slots, budget)])
        host[:, q + 3] = torch.tensor([inverse[i] for i in source])  # each row's prefilled row, among the u
        host[:u, q + 4] = torch.tensor(list(first.values()))  # the u rows prefilled
        if dev.type == "cuda":  # pinned and non-blocking: a pageable copy would wait for every queued step
            host = host.pin_memory()
        on_dev = host.to(dev, non_blocking=True)
        ids, lens, index, rows_budget = on_dev[:, :q], on_dev[:, q], on_dev[:, q + 1], on_dev[:, q + 2]
        of, prefilled = on_dev[:, q + 3], on_dev[:u, q + 4]
        where = torch.arange(q, device=dev)
        lens_u = lens[prefilled]
        mask = None if self.prefill_causal else (  # (u, 1, Q, Q)
            (where[None, :] <= where[:, None])[None, None] & (where < lens_u[:, None])[:, None, None, :])
        st.prefill_slots = index[prefilled]
        try:
            out = model.get_decoder()(input_ids=ids[prefilled], attention_mask=mask,
                                      position_ids=where[None].expand(u, q), past_key_values=st.cache, use_cache=True,
                                      prefill_causal=self.prefill_causal)
        finally:
            st.prefill_slots = None
        if u < k:
            dups = [i for i, j in enumerate(source) if j != i]
            copy_prefix(st, [slots[source[i]] for i in dups], [slots[i] for i in dups], q)
        h = out.last_hidden_state[torch.arange(u, device=dev), lens_u - 1]  # (u, hidden): each last prompt token
        tok, lp = pick(head_logits(model, h, self._mm_fp32)[of], st.temperature, self.generator)  # (k,) each
        active = rows_budget > 0
        tok = torch.where(active, tok, self.pad_id)
        st.valid[index] = torch.arange(st.valid.shape[1], device=dev)[None, :] < lens[:, None]
        st.tokens[index] = self.pad_id
        st.tokens[index, 0] = tok
        st.logps[index] = 0.0
        st.logps[index, 0] = torch.where(active, lp, 0.0)
        st.lengths[index] = active.long()
        hit = active & (tok[:, None] == self.stop_ids).any(-1)
        st.stopped[index] = hit
        st.done[index] = hit | (active.long() >= rows_budget)
        st.budget[index] = rows_budget
        st.tok[index] = tok
        st.pos[index] = lens

    def _decode(self, model, st: SlotState, rows: torch.Tensor) -> None:
        """One decode step of the first n slots on the static buffers (what the graph records); ``rows`` is
        ``st.index[:n]``, so n is a tensor size (symbolic under torch.compile), not a constant."""
        n = rows.shape[0]
        pos, done, lengths = st.pos[:n], st.done[:n], st.lengths[:n]
        # the writes into the cache and the outputs are index_put_: in place under torch.compile (SlotLayer.update)
        st.valid.index_put_((rows, pos), torch.ones((), dtype=torch.bool, device=rows.device))
        lengths_kv = (pos + 1).to(torch.int32) if self.kernels else None  # positions each slot attends to
        out = model.get_decoder()(input_ids=st.tok[:n, None], attention_mask=st.valid[:n, None, None, :],
                                  position_ids=pos[:, None], past_key_values=st.cache, use_cache=True,
                                  slot_lengths=lengths_kv, slot_attention_impl=self.decode_attention)
        logits = head_logits(model, out.last_hidden_state[:, -1], self._mm_fp32)
        if self.kernels:
            tok, lp = sample_rows(logits, st.temperature, st.seed)
            st.seed.add_(1)
        else:
            tok, lp = pick(logits, st.temperature, self.generator)
        active = ~done
        tok = torch.where(active, tok, self.pad_id)
        st.tokens.index_put_((rows, lengths), tok)  # a done row writes its column after the end
        st.logps.index_put_((rows, lengths), torch.where(active, lp, 0.0))
        lengths.add_(active.long())
        hit = active & (tok[:, None] == self.stop_ids).any(-1)
        st.stopped[:n].logical_or_(hit)
        done.logical_or_(hit | (lengths >= st.budget[:n]))
        st.tok[:n].copy_(tok)
        pos.add_(1).clamp_(max=st.valid.shape[1] - 1)  # a done row's position stays in range

    def _step(self, model, st: SlotState, n: int) -> None:
        def decode():  # run only to capture (CUDA) or without graphs: a replay skips the host work here
            rows = st.index[:n]
            if self.compile_dynamic:  # sizes the compiled step treats as symbolic
                st.mark_dynamic()
                torch._dynamo.maybe_mark_dynamic(rows, 0)
            self._decode_fn(model, st, rows)

        if step_graph(st.graphs, n, decode, self.generator, self.cuda_graphs, st.tok.device):
            self.captures += 1
