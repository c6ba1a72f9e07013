"""Evaluation metrics against hand counts; answer extraction; the held-out split (distrl.cmd.evaluate,
distrl.rollout.tasks)."""

from __future__ import annotations

import itertools
import json

import pytest

from distrl.rollout.evaluation import (
    ProblemRecord,
    SampleRecord,
    default_ks,
    maj_at_k,
    majority_vote,
    pass_at_k,
    score_problem,
    summarize,
    summarize_by_group,
)
from distrl.rollout.rewards import normalize_answer
from distrl.rollout.tasks import ArithTask, GSM8KTask, MATH500Task
from tests.helpers import shared_data


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2) = 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3) = 1/10
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # k = 1 is c/n
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct count"):
        pass_at_k(4, 5, 1)


def test_majority_vote_ties_go_to_first_seen():
    assert majority_vote(["3", "5", "5", "3"]) == "3"
    assert majority_vote(["5", "3", "3"]) == "3"
    assert majority_vote([None, None, "7"]) == "7"  # no answer does not vote
    assert majority_vote([None]) is None
    answers, correct = ["3", "5", "5", "3"], [False, True, True, False]
    assert maj_at_k(answers, correct, 1) == 0.0  # "3"
    assert maj_at_k(answers, correct, 3) == 1.0  # "5" twice, correct as its first sample (index 1)
    assert maj_at_k(answers, correct, 4) == 0.0  # tie 2-2 -> "3" (seen first)
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_default_ks():
    assert default_ks(1) == [1] and default_ks(4) == [1, 2, 4] and default_ks(6) == [1, 2, 4, 6]


def _record(prompt_id, correct, answers, lengths, groups):
    samples = [SampleRecord(f"t{i}", a, c, float(c), n, "stop")
               for i, (c, a, n) in enumerate(zip(correct, answers, lengths))]
    return ProblemRecord(prompt_id, "g", groups, samples)


def test_summarize_and_groups_by_hand():
    p1 = _record("p1", [True, False, False, False], ["1", "2", "2", None], [1, 2, 3, 4], {"subject": "A", "level": "1"})
    p2 = _record("p2", [True, True, False, True], ["a", "a", "b", "a"], [5, 5, 5, 5], {"subject": "A", "level": "2"})
    m = summarize([p1, p2], [1, 2, 4])
    # pass@1 = (1/4 + 3/4) / 2; pass@2: p1 1 - C(3,2)/C(4,2) = 1/2, p2 1 (n - c = 1 < 2)
    assert m["accuracy"] == m["pass@1"] == pytest.approx(0.5)
    assert m["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["pass@4"] == 1.0
    # maj@1: "1" (right), "a" (right); maj@2: tie "1"/"2" -> "1"; maj@4: p1 votes "2" (wrong), p2 "a"
    assert (m["maj@1"], m["maj@2"], m["maj@4"]) == (1.0, 1.0, 0.5)
    assert m["mean_length"] == pytest.approx((1 + 2 + 3 + 4 + 20) / 8)
    assert (m["num_problems"], m["num_samples"]) == (2, 4)
    groups = summarize_by_group([p1, p2], [1, 2, 4])
    assert list(groups) == ["level=1", "level=2", "subject=A"]
    assert groups["level=1"]["accuracy"] == 0.25 and groups["level=2"]["accuracy"] == 0.75
    assert groups["subject=A"] == m
    with pytest.raises(ValueError, match="same number"):
        summarize([p1, _record("p3", [True], ["1"], [1], {})], [1])


def test_arith_answers_and_scoring():
    task = ArithTask()
    problem = next(task.problems(0))
    gold = problem.gold
    assert task.extract_answer(f"the answer is \\boxed{{{gold}}}") == gold
    assert task.extract_answer("no digits") is None
    record = score_problem(task, problem, [(f"\\boxed{{{gold}}}", [1, 2, 3], "stop"), ("x", [4], "length")])
    assert [s.correct for s in record.samples] == [True, False]
    assert [s.length for s in record.samples] == [3, 1]
    assert record.groups == {"op": problem.meta["op"]}


def test_normalized_answers_compare_like_the_reward():
    assert normalize_answer("0.5") == normalize_answer("\\frac{1}{2}") == normalize_answer("1/2") == "1/2"
    assert normalize_answer("18.0") == normalize_answer("18") == "18"
    assert normalize_answer(None) is None


def _rows(name: str, n: int) -> list[dict]:
    with open(shared_data() / name) as fh:
        return [json.loads(line) for line in itertools.islice(fh, n)]


def test_gold_solutions_score_correct_math500_gsm8k():
    """Gold solutions as completions, through the same scoring as evaluation: all correct, maj@1 too."""
    math = MATH500Task(_rows("math500/test.jsonl", 12))
    records = [score_problem(math, p, [(row["solution"], [0] * 7, "stop")])
               for p, row in ((math.to_problem(r, i), r) for i, r in enumerate(math.rows))]
    m = summarize(records, [1])
    assert m["accuracy"] == 1.0 and m["maj@1"] == 1.0 and m["mean_length"] == 7
    assert all(r.samples[0].answer == normalize_answer(r.gold) for r in records)
    assert {"subject", "level"} <= set(records[0].groups)
    gsm = GSM8KTask(_rows("gsm8k/test.jsonl", 12))
    records = [score_problem(gsm, gsm.to_problem(r, i), [(r["answer"], [0], "stop"), ("#### -1", [0], "stop")])
               for i, r in enumerate(gsm.rows)]
    m = summarize(records, [1, 2])
    assert m["pass@1"] == 0.5 and m["pass@2"] == 1.0 and m["maj@2"] == 1.0  # tie -> the gold answer (first)
    math.verifier.close()
    gsm.verifier.close()


def test_heldout_is_seeded_and_never_trained_on():
    task = ArithTask(base_seed=3)
    held = task.heldout(16, seed=0)
    assert len({p.prompt_id for p in held}) == 16
    assert [p.prompt_id for p in held] == [p.prompt_id for p in ArithTask(base_seed=3).heldout(16, seed=0)]
    assert [p.prompt_id for p in held] != [p.prompt_id for p in ArithTask(base_seed=3).heldout(16, seed=1)]
    ids = {p.prompt_id for p in held}
    assert not ids & {p.prompt_id for p in itertools.islice(task.problems(7), 20_000)}
    gsm = GSM8KTask(_rows("gsm8k/train.jsonl", 30))
    held = {p.prompt_id for p in gsm.heldout(10, seed=0)}
    seen = {p.prompt_id for p in itertools.islice(gsm.problems(1), 200)}
    assert len(held) == 10 and len(seen) == 20 and not held & seen
    with pytest.raises(ValueError, match="leaves none"):
        GSM8KTask(_rows("gsm8k/train.jsonl", 5)).heldout(5, seed=0)
    with pytest.raises(ValueError, match="more than half"):
        ArithTask(max_operand=1, ops=("+",)).heldout(3, seed=0)


def test_eval_flags_are_checked():
    from distrl.cmd.config import EvalConfig, TrainConfig

    for flags, name in [({"eval_every": -1}, "--eval_every"), ({"eval_size": 0}, "--eval_size"),
                        ({"eval_num_samples": 4}, "--eval_temperature"),
                        ({"eval_temperature": -1.0}, "--eval_temperature")]:
        with pytest.raises(ValueError, match=name):
            TrainConfig(**flags)
    assert TrainConfig(eval_every=2, eval_num_samples=4, eval_temperature=1.0).eval_every == 2
    with pytest.raises(ValueError, match="--temperature"):
        EvalConfig(model="m", num_samples=4, temperature=0.0)
    with pytest.raises(ValueError, match="--ks"):
        EvalConfig(model="m", num_samples=4, ks=(8,))
    with pytest.raises(ValueError, match="--adapter"):
        EvalConfig(model="m", adapter="/nonexistent/v000001")
    assert EvalConfig(model="m").sampling_temperature == 0.0
    assert EvalConfig(model="m", num_samples=8).sampling_temperature == 1.0


def test_periodic_eval_schedule(tmp_path):

    from distrl.rollout.evaluation import PeriodicEval

    log = tmp_path / "eval.jsonl"
    log.write_text('{"version": 0}\n{"version": 3}\n')  # a resumed run: these are not evaluated again
    ev = PeriodicEval(3, ArithTask(), [], log)
    assert ev.done == {0, 3}
    assert [v for v in range(10) if ev.due(v)] == [6, 9]
    assert ev.due(7, final=True) and not ev.due(3, final=True)
    assert ev.skipped(served=4, newest=8) == 6  # 6 was never served: load it before 8
    assert ev.skipped(served=4, newest=6) is None  # 6 is the newest: the ordinary refresh serves it
    assert ev.skipped(served=1, newest=5) is None  # 3 is done already
    assert ev.skipped(served=6, newest=8) is None


def test_prompts_that_do_not_fit_and_foreign_tokenizers_are_refused_naming_the_flag(tmp_path):
    from distrl.cmd.evaluate import check_fits
    from distrl.core.errors import PreflightError
    from distrl.core.tiny import build_tiny_model
    from distrl.rollout.tasks import ArithTask, Problem

    model = str(build_tiny_model(tmp_path / "tiny"))
    task, problems = ArithTask(), [Problem("p", "1+2=" * 10, "30")]  # the prompt is the expression: 40 tokens
    check_fits(model, None, task, problems, max_new_tokens=8, max_model_len=48)  # 40 + 8 fits exactly
    with pytest.raises(PreflightError, match=r"--max_model_len: all 1 prompts are longer as templated \(up to 40 "
                                             r"tokens\) than the 39 that --max_new_tokens 9 leaves under 48"):
        check_fits(model, None, task, problems, max_new_tokens=9, max_model_len=48)
    with pytest.raises(SystemExit, match="--tokenizer .* has 151669 tokens but the model embeds only 52"):
        check_fits(model, str(shared_data() / "tokenizers" / "qwen2.5"), task, problems, 8, None)
