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
