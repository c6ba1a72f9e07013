"""bench/real_model.py --clock launch (issue 43): both sides' clocks from their launch, evaluations left out the
same way, distrl's eval.jsonl placed on the wall clock, and the keys report adds."""

import json

from bench.real_model import (
    case_order,
    eval_spans,
    from_launch,
    launch_clock,
    launch_curve,
    steady_rate,
    summarize,
    version_times,
)


def test_launch_clock_leaves_out_only_the_evaluations_before_t():
    evals = [(105.0, 107.0), (110.0, 111.0), (130.0, 140.0)]
    assert launch_clock(120.0, 100.0, evals) == 17.0  # 20 s less 2 + 1 s of evaluation
    assert launch_clock(135.0, 100.0, evals) == 27.0  # half of the third evaluation lies before t
    assert launch_clock(106.0, 100.0, [(90.0, 107.0)]) == 0.0  # the part before the launch is not counted twice


def test_eval_jsonl_is_placed_on_the_wall_clock_by_its_last_line():
    lines = [{"version": 0, "wall_s": 3.0, "eval_s": 1.0, "accuracy": 0.1},
             {"version": 5, "wall_s": 10.0, "eval_s": 2.0, "accuracy": 0.3}]
    spans = eval_spans(lines, mtime=1010.0)  # the evaluator started at 1000
    assert spans == [(1002.0, 1003.0, 0, 0.1), (1008.0, 1010.0, 5, 0.3)]
    # launched at 990: version 0 evaluated from 12 s; version 5 at 18 s less version 0's 1 s of evaluation
    assert launch_curve(spans, 990.0) == [(12.0, 0, 0.1), (17.0, 5, 0.3)]


def side(curve, first, **kw):
    return {"curve": [(t - curve[0][0], v, a) for t, v, a in curve], "launch_curve": curve, "clock": "launch",
            "first_version_s": first, "startup_s": curve[0][0], "first_version_wall_s": first, "how": "x",
            "peak_memory_gib": None, "command": ""} | kw


def test_from_launch_pairs_runs_and_reports_startup_and_recompiles():
    results = {"distrl1.cold": side([(100.0, 0, 0.1)], 110.0),
               "distrl1": side([(20.0, 0, 0.1), (25.0, 10, 0.15), (30.0, 25, 0.21)], 22.0, recompiles_after_warmup=0),
               "trl_vllm.cold": side([(40.0, 0, 0.1)], 50.0),
               "trl_vllm": side([(15.0, 0, 0.1), (40.0, 20, 0.18), (75.0, 35, 0.2)], 18.0),
               "distrl1#2": side([(21.0, 0, 0.1), (29.0, 25, 0.2)], 24.0, recompiles_after_warmup=0),
               "trl_vllm#2": side([(15.0, 0, 0.1), (90.0, 35, 0.25)], 18.0)}
    out = from_launch(results)
    assert out["launch_target_accuracy"] == 0.2
    assert (out["startup_s"], out["startup_s_runs"]) == (24.0, [22.0, 24.0])  # the largest warm start-up
    assert (out["startup_cold_s"], out["startup_cold_s_runs"]) == (110.0, [110.0])
    assert (out["recompiles_after_warmup"], out["recompiles_after_warmup_runs"]) == (0, [0, 0])
    assert out["distrl_time_to_target_from_launch_s"] == [30.0, 29.0]
    assert out["trl_vllm_time_to_target_from_launch_s"] == [75.0, 90.0]
    assert out["vs_trl_vllm_time_to_accuracy_from_launch_runs"] == [2.5, 3.103]
    assert out["vs_trl_vllm_time_to_accuracy_from_launch"] == 2.5
    assert "vs_trl_time_to_accuracy_from_launch" not in out  # no trl (HF) case ran
    summary = summarize(results)  # the training-clock keys leave the cold runs out
    assert summary["vs_trl_vllm_time_to_accuracy_from_launch"] == 2.5 and summary["startup_s"] == 24.0
    assert summary["accuracy_before"] == 0.1 and set(summary["cases"]) == set(results)


def test_cold_runs_come_first_for_the_cases_that_compile():
    class Args:
        cases, clock, cold = "distrl1,trl_vllm,trl", "launch", "on"

    assert case_order(Args) == ["distrl1.cold", "distrl1", "trl_vllm.cold", "trl_vllm", "trl"]
    Args.clock = "train"
    assert case_order(Args) == ["distrl1", "trl_vllm", "trl"]


def test_steady_rate_from_the_consumption_log_and_warm_over_cold(tmp_path):
    lines = [{"learner_version": v, "rank": r, "time": 100.0 + 2 * v + r} for v in range(6) for r in (0, 1)]
    (tmp_path / "consumed.jsonl").write_text("".join(f"{json.dumps(x)}\n" for x in lines) + "{torn")
    times = version_times(tmp_path)
    assert times == {v: 100.0 + 2 * v for v in range(6)}  # rank 0's line; a torn last line is skipped
    assert steady_rate(times, 5) == 0.5  # versions 1..5: 4 versions in 8 s; version 0 (its compiles) left out
    assert steady_rate(times, 1) is None and steady_rate(times, 9) is None  # too short; never reached
    cold, warm = side([(100.0, 0, 0.1)], 110.0), side([(20.0, 0, 0.1)], 22.0)
    cold["steady_versions_per_s"], warm["steady_versions_per_s"] = 0.5, 0.49
    out = from_launch({"distrl1.cold": cold, "distrl1": warm})
    assert (out["steady_warm_vs_cold"], out["steady_warm_vs_cold_runs"]) == (0.98, [0.98])
    assert "steady_warm_vs_cold" not in from_launch({"distrl1.cold": side([(1.0, 0, 0.1)], 2.0), "distrl1": warm})
