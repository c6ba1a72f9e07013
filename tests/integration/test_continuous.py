"""Continuous batching in the HF engine (distrl/rollout/engines/hf/continuous.py) on the tiny model, CPU, fp32:
the same greedy tokens and logprobs (within 1e-5) as static batching when rows end apart and slots are
refilled; exact sampled logprobs for rows admitted mid-call; per-completion policy versions under an
in-flight update; groups handed back as they end."""

from __future__ import annotations

import re

import pytest
import torch

from distrl.rollout.engines.hf.engine import INFLIGHT_INTERVAL, HFEngine
from tests.helpers import scaled_model

pytestmark = pytest.mark.usefixtures("no_garbage_while_tracing")

PROMPTS = ["1+2=", "12*3= and then 4", "(7+5)*3 = 36, so then 2*", "9-4=", "123456789+987654321=", "8"]
NEW = 24
MAX_LEN = 34  # prompt + completion: rows of longer prompts get fewer new tokens (budgets 24, 18, 10, 24, 14, 24)


def engine(model, **kwargs) -> HFEngine:
    return HFEngine(str(model), dtype="float32", max_model_len=MAX_LEN, **kwargs)


def flat(results) -> list:
    return [c for r in results for c in r.completions]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """``sharp``: the tiny model (seed 2) with its weights doubled, whose greedy rows are not one repeated
    token (one ends on EOS after 5 tokens, the others at their budgets); ``full``: another version of it."""
    from distrl.core.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("continuous")
    sharp = scaled_model(build_tiny_model(root / "tiny", seed=2), root / "sharp", 2.0)
    return dict(sharp=sharp, full=scaled_model(sharp, root / "full", 1.0, noise=0.05, seed=4))


def assert_same(a, b, atol: float = 1e-5) -> float:
    """Same token ids, finish reasons and texts; logprobs within ``atol``; returns the largest gap."""
    ca, cb = flat(a), flat(b)
    assert [(c.token_ids, c.finish_reason, c.text) for c in ca] == [(c.token_ids, c.finish_reason, c.text) for c in cb]
    worst = max(max((abs(x - y) for x, y in zip(p.logprobs, q.logprobs)), default=0.0) for p, q in zip(ca, cb))
    assert worst <= atol, worst
    return worst


def test_continuous_equals_static_when_rows_end_apart(w):
    expected = engine(w["sharp"], batching="static").generate(PROMPTS, 2, 0.0, NEW)
    lengths = sorted(len(c.token_ids) for c in flat(expected))
    assert len(set(lengths)) >= 3 and {c.finish_reason for c in flat(expected)} == {"stop", "length"}, lengths
    assert_same(expected, engine(w["sharp"], batching="static", max_num_seqs=5).generate(PROMPTS, 2, 0.0, NEW))
    for slots in (None, 3):  # every row at once; 3 slots for 12 rows: refilled as rows end
        e = engine(w["sharp"], max_num_seqs=slots)
        prefilled = []  # rows of each prefill: a group's prompt is prefilled once, its K/V copied to the others
        e.base.get_decoder().register_forward_pre_hook(
            lambda mod, args, kw, seen=prefilled: seen.append(len(kw["input_ids"])) if kw["input_ids"].shape[1] > 1
            else None, with_kwargs=True)
        handed = list(e.generate_groups(PROMPTS, 2, 0.0, NEW))
        # all at once: one prefill of the 6 prompts; 3 slots: admissions that take both rows of a prompt share it
        assert prefilled == [len(PROMPTS)] if slots is None else sum(prefilled) < 2 * len(PROMPTS), prefilled
        got = [r for _, r in sorted((i, r) for batch in handed for i, r in batch)]
        worst = assert_same(expected, got)
        print(f"slots {slots}: {len(handed)} hand-backs, lengths {lengths}, largest logprob gap {worst:.2e}")
        assert sorted(i for batch in handed for i, _ in batch) == list(range(len(PROMPTS)))
        ends = [[max(len(c.token_ids) for c in r.completions) for _, r in batch] for batch in handed]
        assert len(handed) >= 3
        if slots is None:  # all rows start together: groups that end earlier are handed back earlier
            assert all(max(a) < min(b) for a, b in zip(ends, ends[1:])), ends
        assert all(c.versions == (0, 0) for c in flat(got))


def test_sampled_logprobs_of_refilled_rows_equal_fp32_recomputation(w):
    from transformers import AutoModelForCausalLM

    results = engine(w["sharp"], max_num_seqs=2, seed=5).generate(PROMPTS, 3, 0.7, 16)
    model = AutoModelForCausalLM.from_pretrained(str(w["sharp"]), dtype=torch.float32).eval()
    worst = 0.0
    for r in results:
        for c in r.completions:
            ids = torch.tensor([r.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float() / 0.7
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    print(f"sampled, 2 slots for 18 rows: largest gap to fp32 recomputation {worst:.2e}")
    assert worst < 1e-5
    assert len({tuple(c.token_ids) for c in flat(results)}) > 6  # sampled, not greedy


def test_inflight_update_stamps_each_completion_with_its_versions(w):
    """2 slots, 4 rows of at most 3 intervals: version 1 is loaded after the first interval. Rows 0-1 ran
    under versions 0 then 1; rows 2-3 were admitted after the load and equal version 1's own greedy rows."""
    e = engine(w["sharp"], max_num_seqs=2)
    calls = []

    def switch():
        calls.append(e.version)
        if e.version == 0:
            e.load_weights(1, "full", w["full"])

    new = 3 * INFLIGHT_INTERVAL
    got = e.generate(PROMPTS[:4], 1, 0.0, new, between_steps=switch)
    # rows 0 and 1 (budgets 24 and 18) run past the load at token 8; rows 2 and 3 start after them
    assert [c.versions for c in flat(got)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert calls[0] == 0 and e.version == 1
    v0 = engine(w["sharp"], batching="static").generate(PROMPTS[:2], 1, 0.0, new)
    k = INFLIGHT_INTERVAL
    assert [c.token_ids[:k] for c in flat(got)[:2]] == [c.token_ids[:k] for c in flat(v0)]
    assert [c.token_ids for c in flat(got)[:2]] != [c.token_ids for c in flat(v0)]
    v1 = engine(w["full"], batching="static").generate(PROMPTS[2:4], 1, 0.0, new)
    print(f"in-flight: versions {[c.versions for c in flat(got)]}, lengths {[len(c.token_ids) for c in flat(got)]}, "
          f"rows admitted after the load vs version 1 alone: largest logprob gap {assert_same(v1, got[2:]):.2e}")


def test_lookahead_hands_each_row_back_once_one_interval_late(w):
    """3 slots, 7 rows of budgets 3..13 (no stop token), a look every 4 tokens: a row that ends in interval i is
    handed back after interval i + 1 (while rows wait, its slot is refilled then), except at an interval whose
    end every running row has reached its budget; with ``lookahead=False`` at the end of its own interval. Each
    row exactly once, with its full budget, the same tokens either way. The stamp counts decode steps."""
    from distrl.rollout.engines.hf.continuous import ContinuousSampler

    e = engine(w["sharp"])
    ids = [e.tokenizer(p)["input_ids"] for p in PROMPTS] + [e.tokenizer("5+5=")["input_ids"]]
    budget = [3, 13, 5, 4, 9, 6, 7]
    at, tokens = {}, {}
    for lookahead in (True, False):
        sampler = ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long), torch.Generator(),
                                    cuda_graphs=False, interval=4, lookahead=lookahead)
        steps, step = [0], sampler._step

        def counted(*args, step=step, steps=steps):
            steps[0] += 1
            step(*args)

        sampler._step = counted
        calls = sampler.run(ids, budget, 0.0, slots=3, stamp=lambda steps=steps: steps[0])
        handed = [f for done in calls for f in done]
        assert sorted(f.row for f in handed) == list(range(7))
        assert all(len(f.tokens) == budget[f.row] for f in handed)
        at[lookahead] = {f.row: f.versions for f in handed}  # (steps at admission, steps at hand-back)
        tokens[lookahead] = {f.row: f.tokens for f in handed}
    assert tokens[True] == tokens[False]
    ahead, sync = at[True], at[False]
    # row 0 (3 tokens: the prefill's and 2 steps) ends in the first interval (3 steps); handed back after the
    # second (7 steps), where row 3, the first waiting, takes its slot; without look-ahead after the first
    assert ahead[0] == (0, 7) and ahead[3][0] == 7 and sync[0] == (0, 3) and sync[3][0] == 3, (ahead, sync)
    # without look-ahead every row is handed back at the end of the interval it ends in
    assert all(sync[r][1] - sync[r][0] <= budget[r] - 1 + 3 for r in sync), sync
    # the row that reaches its budget last: the interval where it does is read at once (all others ended)
    last = max(ahead, key=lambda r: ahead[r][0] + budget[r] - 1)
    assert ahead[last][1] - ahead[last][0] <= budget[last] - 1 + 3, (ahead, sync)
    # once no row waits (after the last admission), a row that ends before the last is handed back one interval late
    admitted_last = max(v[0] for v in ahead.values())
    assert any(ahead[r][1] - ahead[r][0] > budget[r] - 1 + 3 for r in ahead
               if ahead[r][0] + budget[r] - 1 > admitted_last and r != last), (ahead, sync)


def test_states_are_reused_across_calls_of_varying_shapes(w):
    """A call with a longer prompt grows the slot state; later shorter calls reuse it (no new state: on CUDA
    no new compiled shape or graph), a call with another slot count keeps a second state; every call's rows
    equal a fresh engine's (positions past a row's own are masked)."""
    long_prompt = "1+2=3, " * 14 + "4+5="  # over 64 tokens: a longer state than the short prompts'
    calls = [(PROMPTS[:3], 2), ([long_prompt, PROMPTS[1], PROMPTS[2]], 2), (PROMPTS[3:6], 2), (PROMPTS[:2], 1)]

    def make():
        return HFEngine(str(w["sharp"]), dtype="float32", max_model_len=200)

    e = make()
    made = []
    for prompts, n in calls:
        assert_same(make().generate(prompts, n, 0.0, NEW), e.generate(prompts, n, 0.0, NEW))
        made.append(e._continuous.states_made)
    # 6 rows (one state), 6 rows with a longer prompt (grown), 6 rows (reused), 2 rows (a second state)
    assert made == [1, 2, 2, 3], made
    assert sorted(e._continuous._states) == [2, 6]
    assert e._continuous._states[6].valid.shape[1] > 128  # the grown one was kept


def test_compiled_step_writes_the_kv_cache_in_place(w):
    """Under torch.compile (inductor, CPU here as on CUDA) the decode step writes each slot's new K/V in place:
    the generated code allocates no buffer of the cache's shape (a scatter_ there copied the whole cache twice a
    step: issue 23's profile, 3.7 of 10.3 ms at 1024 rows on an H200). Its rows equal the eager step's."""
    from torch._inductor.utils import run_and_get_code

    from distrl.rollout.engines.hf.continuous import ContinuousSampler

    e = engine(w["sharp"])
    ids = [e.tokenizer(p)["input_ids"] for p in PROMPTS]
    budget = [5, 13, 3, 9, 7, 11]

    def rows(compile_step: bool):
        sampler = ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long), torch.Generator(),
                                    cuda_graphs=False, interval=4, compile_step=compile_step)
        got = {f.row: (f.tokens, f.logprobs) for done in sampler.run(ids, budget, 0.0, slots=3) for f in done}
        return got, sampler._states[3]

    torch._dynamo.reset()
    (compiled, st), code = run_and_get_code(rows, True)
    _, _, heads, dim = st.cache.layers[0].keys.shape  # (slots, L, Hkv, D); sizes may be symbols (s12)
    # a buffer of the cache's shape, in its layout or in attention's (n, Hkv, L, D), not the step's (n, Hkv, 1, D)
    cache_like = re.compile(rf"empty_strided_cpu\(\(\w+, (?:(?!1,)\w+, {heads}|{heads}, (?!1,)\w+), {dim}\)")
    found = [m.group(0) for c in code for m in cache_like.finditer(c)]
    assert code and not found, found
    assert any(f", {heads}, 1, {dim})" in c for c in code)  # the step's new K/V: the pattern reads this code
    eager, _ = rows(False)
    assert {r: t for r, (t, _) in compiled.items()} == {r: t for r, (t, _) in eager.items()}
    assert max(abs(a - b) for r in eager for a, b in zip(compiled[r][1], eager[r][1])) <= 1e-5


def test_one_compilation_serves_every_state_bucket_and_temperature(w):
    """The compiled step (inductor, CPU here as on CUDA) is compiled once, with dynamic sizes: a greedy call whose
    tail shrinks to a smaller bucket (32 -> 8 slots), then a sampled call of other slots and longer rows (a new
    state) compile nothing more. (Compiled per shape, the same calls compiled again: the stalls of BENCHMARKS.md's
    fourth round; that contrast is not re-run here, it cost three more CPU compilations of the test suite's time.)"""
    from torch._dynamo.utils import counters

    from distrl.rollout.engines.hf.continuous import ContinuousSampler

    e = engine(w["sharp"])
    ids = [e.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(40)]

    torch._dynamo.reset()
    counters.clear()
    sampler = ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long),
                                torch.Generator().manual_seed(0), cuda_graphs=False, interval=4,
                                compile_step=True, compile_dynamic=True)
    seen = []
    for rows, budget, temperature, slots in ((ids, [2 + (7 * i) % 39 for i in range(40)], 0.0, 32),
                                             (ids[:12], [70] * 12, 1.0, 12)):
        for _ in sampler.run(rows, budget, temperature, slots=slots):
            pass
        seen.append(counters["stats"]["unique_graphs"])
    assert sampler.states_made == 2
    first, after = seen
    assert first >= 1 and after == first, (first, after)


def test_reserved_kv_slots_compile_once_and_give_the_same_rows(w):
    """``reserve(32)`` before the first call: every state's K/V has 32 slots (the compiled step then traces their
    slot count as a constant), a call of 12 slots and longer rows (a new state) compiles nothing more, and the rows
    equal an unreserved sampler's. A call of more rows than reserved raises the reservation and drops the states."""
    from torch._dynamo.utils import counters

    from distrl.rollout.engines.hf.continuous import ContinuousSampler

    e = engine(w["sharp"])
    ids = [e.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(40)]
    calls = ((ids[:32], [2 + (7 * i) % 39 for i in range(32)], 32), (ids[:12], [70] * 12, 12))

    def sampler(compile_step: bool) -> ContinuousSampler:
        return ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long),
                                 torch.Generator().manual_seed(0), cuda_graphs=False, interval=4,
                                 compile_step=compile_step)

    def rows(s: ContinuousSampler, call) -> dict:
        return {f.row: (f.tokens, f.logprobs) for done in s.run(call[0], call[1], 0.0, slots=call[2]) for f in done}

    torch._dynamo.reset()
    counters.clear()
    reserved, plain, seen = sampler(True), sampler(False), []
    reserved.reserve(32)
    for call in calls:
        got, want = rows(reserved, call), rows(plain, call)
        assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
        assert max(abs(a - b) for r in want for a, b in zip(got[r][1], want[r][1])) <= 1e-5
        assert reserved._states[call[2]].cache.layers[0].keys.shape[0] == 32
        seen.append(counters["stats"]["unique_graphs"])
    assert seen[0] >= 1 and seen[1] == seen[0], seen
    reserved.reserve(8)  # never lowered
    assert reserved.kv_slots == 32 and sorted(reserved._states) == [12, 32]
    reserved._prepare(e.base, 40, 64, 64)  # more rows than reserved: raised, the states made before dropped
    assert reserved.kv_slots == 40 and sorted(reserved._states) == [40]
    with pytest.raises(ValueError, match="at least one slot"):
        reserved.reserve(0)


def test_stepping_the_free_slots_after_a_call_changes_no_later_row(w):
    """What ``_capture_buckets`` does at the end of a state's first call on CUDA (a graph per bucket, captured
    while every slot is free), run eagerly here: a step of each bucket over the free slots leaves the next
    call's rows (greedy, refilled slots, a shrinking tail) equal to a fresh sampler's."""
    from distrl.rollout.engines.hf.continuous import ContinuousSampler
    from distrl.rollout.engines.hf.decode import grouped_attention_mode

    e = engine(w["sharp"])
    ids = [e.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(40)]
    budget = [2 + (7 * i) % 39 for i in range(40)]

    def sampler():
        return ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long), torch.Generator(),
                                 cuda_graphs=False, interval=4)

    stepped = sampler()
    list(stepped.run(ids[:32], budget[:32], 0.0, slots=32))
    st = stepped._states[32]
    before = st.pos.clone()
    with torch.inference_mode(), grouped_attention_mode(e.base):
        for n in (32, 8, 8):
            stepped._step(e.base, st, n)
    assert (st.pos != before).sum() >= 8  # the free slots' steps did write (a position at the end stays)
    fresh = sampler()
    got = {f.row: f for done in stepped.run(ids, budget, 0.0, slots=32) for f in done}
    want = {f.row: f for done in fresh.run(ids, budget, 0.0, slots=32) for f in done}
    assert sorted(got) == list(range(40)) and all(got[r].tokens == want[r].tokens for r in want)
    assert max(abs(a - b) for r in want for a, b in zip(got[r].logprobs, want[r].logprobs)) <= 1e-6


def test_the_tail_decodes_fewer_slots_with_the_same_rows(w):
    """32 slots, 40 rows of budgets 2..40 (no stop token), greedy: once no row waits, the step decodes only the
    smallest bucket (32, 8) that holds the running rows, which move below it. Every row equals static
    batching's (which never shrinks): same tokens, logprobs within 1e-5; and the step ran at 8 slots."""
    from distrl.rollout.engines.hf.continuous import ContinuousSampler
    from distrl.rollout.engines.hf.slots import buckets

    assert buckets(32) == [32, 8] and buckets(12) == [12] and buckets(256) == [256, 64, 16]
    e = engine(w["sharp"])
    ids = [e.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(40)]
    budget = [2 + (7 * i) % 39 for i in range(40)]
    sampler = ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long), torch.Generator(),
                                cuda_graphs=False, interval=4)
    ran, step = [], sampler._step

    def counted(model, st, n):
        ran.append(n)
        step(model, st, n)

    sampler._step = counted
    got = {f.row: f for done in sampler.run(ids, budget, 0.0, slots=32) for f in done}
    continuous, ran[:] = list(ran), []
    static = {f.row: f for done in sampler.run(ids, budget, 0.0, slots=32, static=True) for f in done}
    assert sorted(got) == sorted(static) == list(range(40))
    assert all(got[r].tokens == static[r].tokens and len(got[r].tokens) == budget[r] for r in got)
    assert max(abs(a - b) for r in got for a, b in zip(got[r].logprobs, static[r].logprobs)) <= 1e-5
    assert set(ran) == {32}  # static batching never shrinks
    assert {32, 8} == set(continuous) and continuous == sorted(continuous, reverse=True), continuous


def test_causal_prefill_equals_the_masked_reference(w):
    """The prefill by SDPA with ``is_causal`` (the default: right-padded prompts of 1-13 tokens, no mask held) gives
    the rows the (k, 1, Q, Q)-masked prefill gives: same greedy tokens, logprobs within 1e-5 (fp32, CPU)."""
    from distrl.rollout.engines.hf.continuous import ContinuousSampler

    e = engine(w["sharp"])
    ids = [e.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"][: 1 + i % 13] for i in range(20)]
    assert len({len(r) for r in ids}) >= 8  # rows padded by different amounts
    budget = [3 + (5 * i) % 17 for i in range(20)]
    rows = {}
    for attention in ("causal", "masked"):
        sampler = ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long), torch.Generator(),
                                    cuda_graphs=False, interval=4, prefill_attention=attention)
        rows[attention] = {f.row: f for done in sampler.run(ids, budget, 0.0, slots=8) for f in done}
    got, want = rows["causal"], rows["masked"]
    assert sorted(got) == sorted(want) == list(range(20))
    assert all(got[r].tokens == want[r].tokens and len(got[r].tokens) == budget[r] for r in want)
    assert max(abs(a - b) for r in want for a, b in zip(got[r].logprobs, want[r].logprobs)) <= 1e-5
    with pytest.raises(ValueError, match="prefill_attention"):
        ContinuousSampler(lambda: e.base, e.pad_id, torch.empty(0, dtype=torch.long), torch.Generator(),
                          cuda_graphs=False, prefill_attention="flash")
