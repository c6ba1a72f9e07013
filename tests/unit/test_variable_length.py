"""bench/variable_length.py: the ideal ratio, the seeded lengths and its CPU smoke run (issue 23 (b), (c))."""

import json
import math

from bench.variable_length import draw_lengths, ideal_ratio, main


def test_ideal_ratio_counts_each_static_batch_at_its_longest_row():
    # batches [10, 2] and [3, 3] and [5]: (10*2 + 3*2 + 5*1) / 23
    assert math.isclose(ideal_ratio([10, 2, 3, 3, 5], 2), 31 / 23)
    assert ideal_ratio([7, 7, 7, 7], 2) == 1.0


def test_lengths_are_seeded_capped_and_long_tailed():
    a = draw_lengths(4000, median=150, sigma=0.8, cap=1024, seed=3)
    assert a == draw_lengths(4000, median=150, sigma=0.8, cap=1024, seed=3)
    assert a != draw_lengths(4000, median=150, sigma=0.8, cap=1024, seed=4)
    assert 1 <= min(a) and max(a) == 1024  # the tail reaches the cap
    assert 135 <= sorted(a)[2000] <= 165
    assert sum(a) / len(a) > 1.25 * sorted(a)[2000]  # mean above median: long right tail


def test_smoke_runs_both_modes_to_the_same_tokens(tmp_path):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "variable_length.json").read_text())
    cont = res["continuous"]
    assert cont["tokens"] > 0 and cont["continuous_ideal_ratio"] >= 1.0
    assert math.isclose(cont["continuous_vs_ideal"], cont["continuous_vs_static"] / cont["continuous_ideal_ratio"],
                        rel_tol=0.01)
    assert 0 < res["decode"]["b4"]["tok_s"] < res["decode"]["b4"]["roofline_tok_s"]
    assert res["summary"]["decode_roofline_fraction_b4"] == res["decode"]["b4"]["roofline_fraction"]
    b4 = res["decode"]["b4"]
    # decode_steps_tok_s comes from a difference of two timings (15 steps against the 1-token call's 7): None when a
    # loaded machine makes it non-positive, with its fractions None too; timing itself is not asserted here.
    steps = b4["decode_steps_tok_s"]
    assert (steps is None and b4["decode_steps_roofline_fraction"] is None) or steps > 0
    assert len(b4["prefill_s"]) == 1
    assert len(b4["prefill"]["causal_s"]) == len(b4["prefill"]["masked_s"]) == 1 and b4["prefill"]["causal_speedup"] > 0


def test_call_steps_counts_the_steps_to_the_last_look():
    """A call's first token comes from the prefill; the host looks every 8 tokens, so a row of 1 token still runs 7
    steps and one of 512 runs 511: the decode steps a 512-token call runs more than a 1-token call are 504."""
    from bench.variable_length import call_steps

    assert [call_steps(n) for n in (1, 8, 9, 256, 512)] == [7, 7, 15, 255, 511]


def test_compute_roofline_adds_the_bound_of_each_part():
    """The 0.5B architecture (494,032,768 parameters) at 1024 rows, 64 + 256 tokens (mean context 192):
    weight products 2 x 494.03e6 x 1024 = 1.0118 TFLOP / 790e12 = 1.2808 ms (compute-bound: the weights'
    0.988 GB take 0.2298 ms at 4.3 TB/s); attention 1024 x 4 x 24 x 14 x 64 x 192 = 16.91 GFLOP (0.0214 ms)
    against K/V 1024 x 192 x (2 x 24 x 2 x 64 x 2 B) = 2.416 GB (0.5619 ms): 1.8427 ms a step, 555,700 tok/s.
    At 1 row both parts are bound by memory: (0.988 GB + 192 x 12,288 B) / 4.3 TB/s."""
    from types import SimpleNamespace

    from bench.variable_length import compute_roofline_tok_s, roofline_tok_s

    cfg = SimpleNamespace(hidden_size=896, num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2)
    tok_s, formula = compute_roofline_tok_s(494_032_768, cfg, 1024, 64, 256)
    assert math.isclose(tok_s, 1024 / 1.8427e-3, rel_tol=1e-3) and "1.281 + 0.562 ms" in formula
    one, _ = compute_roofline_tok_s(494_032_768, cfg, 1, 64, 256)
    memory_only, _ = roofline_tok_s(2 * 494_032_768, cfg, 1, 64, 256)
    assert math.isclose(one, memory_only, rel_tol=1e-9)
