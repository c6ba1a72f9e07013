"""bench/real_model.py's time to accuracy: run k pairs the k-th distrl1 case with the k-th trl case (issue 23 (e))."""

from bench.real_model import time_to_accuracy


def case(curve):
    return {"curve": curve, "how": "stopped at the time cap", "peak_memory_gib": None, "command": ""}


def test_runs_pair_in_order_against_the_common_base():
    results = {"distrl1": case([(0.0, 0, 0.1), (5.0, 10, 0.15), (10.0, 20, 0.2)]),
               "trl": case([(0.0, 0, 0.1), (20.0, 10, 0.21)]),
               "distrl2": case([(0.0, 0, 0.0), (1.0, 5, 0.5)]),  # another held-out set: not paired
               "distrl1#2": case([(0.0, 0, 0.1), (4.0, 10, 0.25)]),
               "trl#2": case([(0.0, 0, 0.1), (30.0, 10, 0.19), (36.0, 20, 0.2)])}
    out = time_to_accuracy(results)
    assert out["target_accuracy"] == 0.2
    assert out["distrl_time_to_target_s"] == [10.0, 4.0] and out["trl_time_to_target_s"] == [20.0, 36.0]
    assert out["vs_trl_time_to_accuracy_runs"] == [2.0, 9.0] and out["vs_trl_time_to_accuracy"] == 2.0


def test_a_run_that_never_reaches_the_target_has_no_ratio():
    results = {"distrl1": case([(0.0, 0, 0.1), (5.0, 5, 0.3)]), "trl": case([(0.0, 0, 0.1), (60.0, 50, 0.15)])}
    out = time_to_accuracy(results)
    assert out["vs_trl_time_to_accuracy_runs"] == [None] and out["vs_trl_time_to_accuracy"] is None
    assert time_to_accuracy({"distrl1": case([(0.0, 0, 0.1)])}) == {}
