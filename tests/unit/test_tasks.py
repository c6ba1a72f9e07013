"""Tasks and rewards (distrl.rollout.tasks, distrl.rollout.rewards) on the real GSM8K / MATH-500 rows in shared/data."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from distrl.rollout.answers import final_answer
from distrl.rollout.rewards import MathVerifier
from distrl.rollout.tasks import ArithTask, GSM8KTask, HalfVocabTask, MATH500Task, Problem, load_task
from tests.helpers import shared_data

GSM8K = shared_data() / "gsm8k" / "train.jsonl"
MATH500 = shared_data() / "math500" / "test.jsonl"
QWEN = shared_data() / "tokenizers" / "qwen2.5"


def read_rows(path, n=None):
    with open(path) as f:
        return [json.loads(line) for line in itertools.islice(f, n)]


@pytest.fixture(scope="module")
def gsm8k():
    task = GSM8KTask(read_rows(GSM8K))
    yield task
    task.verifier.close()


@pytest.fixture(scope="module")
def math500():
    task = MATH500Task(read_rows(MATH500))
    yield task
    task.verifier.close()


def run_in_thread(fn, *args):
    """fn(*args) in a non-main threading.Thread; returns its result, re-raises its exception."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001  (handed to the main thread)
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "reward did not return within 120 s"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---- GSM8K -----------------------------------------------------------------------------------------------

def test_gsm8k_gold_is_text_after_last_hashes_without_commas(gsm8k):
    assert [gsm8k.to_problem(gsm8k.rows[i], i).gold for i in range(5)] == ["72", "10", "5", "42", "624"]
    assert gsm8k.to_problem(gsm8k.rows[367], 367).gold == "850000"  # "#### 850,000"
    assert gsm8k.to_problem(gsm8k.rows[0], 0).prompt_id == "gsm8k:0"


@pytest.mark.parametrize("index", [0, 1, 2, 3, 4, 345, 367])
def test_gsm8k_right_answer_scores_1_wrong_scores_0(gsm8k, index):
    p = gsm8k.to_problem(gsm8k.rows[index], index)
    boxed_right = f"Step by step... so the total is \\boxed{{{p.gold}}}."
    assert gsm8k.reward(boxed_right, [], p) == (1.0, {"correct": 1.0, "format": 1.0, "gold_unparsable": 0.0,
                                                    "timeout": 0.0})
    # No \boxed{}: the last number counts; thousands separators are accepted.
    assert gsm8k.reward(f"It costs 3 dollars each.\n#### {int(p.gold):,}", [], p)[0] == 1.0
    # The reference solution itself (worked steps ending in "#### N") scores 1.
    assert gsm8k.reward(gsm8k.rows[index]["answer"], [], p)[0] == 1.0
    wrong = str(int(p.gold) + 1)
    assert gsm8k.reward(f"\\boxed{{{wrong}}}", [], p) == (0.0, {"correct": 0.0, "format": 1.0,
                                                                "gold_unparsable": 0.0, "timeout": 0.0})
    # The last \boxed{} wins over numbers after it and over earlier boxes.
    assert gsm8k.reward(f"\\boxed{{{wrong}}} no, \\boxed{{{p.gold}}} (not {wrong})", [], p)[0] == 1.0
    assert gsm8k.reward(f"\\boxed{{{p.gold}}} no, \\boxed{{{wrong}}}", [], p)[0] == 0.0
    assert gsm8k.reward("I do not know.", [], p)[0] == 0.0


@pytest.mark.parametrize("gold", ["", "   ", "#", "}{"])
def test_unparsable_gold_never_scores(gsm8k, gold):
    p = Problem("x", "q", gold)
    for completion in (f"\\boxed{{{gold}}}", gold, "\\boxed{}", "42"):
        assert gsm8k.reward(completion, [], p) == (0.0, {"correct": 0.0, "format": float("\\boxed" in completion),
                                                       "gold_unparsable": 1.0, "timeout": 0.0})


def test_gsm8k_row_without_hashes_has_unparsable_gold():
    task = GSM8KTask([{"question": "q", "answer": "no final line"}], verify_timeout_s=None)
    p = next(task.problems(0))
    assert p.gold == ""
    assert task.reward("\\boxed{}", [], p)[1]["gold_unparsable"] == 1.0


# ---- MATH-500 --------------------------------------------------------------------------------------------

def test_math500_problem_fields(math500):
    p = math500.to_problem(math500.rows[219], 219)
    assert (p.prompt_id, p.gold, p.meta) == ("test/counting_and_probability/282.json", "\\frac{1}{2}",
                                             {"subject": "Counting & Probability", "level": 4})
    assert p.question == math500.rows[219]["problem"]


@pytest.mark.parametrize("completion,expected", [
    ("Therefore the probability is $\\boxed{\\frac{1}{2}}$.", 1.0),
    ("so the answer is \\boxed{0.5}", 1.0),  # math_verify: 0.5 == 1/2
    ("\\boxed{\\dfrac{1}{2}}", 1.0),
    ("\\boxed{1/2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", 0.0),
    ("\\boxed{2}", 0.0),
    ("The answer is 0.5", 1.0),  # no \boxed{}: the stated answer
    ("The answer is $\\frac{1}{2}$.", 1.0),
])
def test_math500_fraction_answers(math500, completion, expected):
    p = math500.to_problem(math500.rows[219], 219)  # gold \frac{1}{2}
    assert math500.reward(completion, [], p)[0] == expected


def test_math500_every_gold_matches_itself_and_text_answers(math500):
    for i in range(0, 500, 25):
        p = math500.to_problem(math500.rows[i], i)
        assert math500.reward(f"\\boxed{{{p.gold}}}", [], p)[0] == 1.0, p.gold
    p = math500.to_problem(math500.rows[227], 227)  # gold \text{(C)}
    assert math500.reward("\\boxed{\\text{(C)}}", [], p)[0] == 1.0
    assert math500.reward("\\boxed{\\text{(A)}}", [], p)[0] == 0.0


def test_math500_solution_only_rows_take_last_boxed():
    task = MATH500Task([{"problem": "1+1?", "solution": "It is $\\boxed{2}$."}], verify_timeout_s=None)
    assert next(task.problems(0)).gold == "2"


# ---- math_verify outside the main thread, and its timeout --------------------------------------------------

def test_math_verify_default_timeouts_fail_in_a_thread():
    """The premise: math_verify's SIGALRM timeouts refuse to run outside the main thread."""
    from math_verify import parse

    with pytest.raises(ValueError, match="thread"):
        run_in_thread(parse, "\\boxed{1}")


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_reward_works_in_a_thread(timeout_s):
    task = MATH500Task(read_rows(MATH500, 300), verify_timeout_s=timeout_s)
    p = task.to_problem(task.rows[219], 219)
    assert run_in_thread(task.reward, "\\boxed{0.5}", [], p)[0] == 1.0
    assert run_in_thread(task.reward, "\\boxed{0.25}", [], p)[0] == 0.0
    task.verifier.close()


def test_hanging_answer_times_out_and_the_worker_restarts():
    verifier = MathVerifier(timeout_s=1.0)
    try:
        # sympy does not return on this one for over a minute; the child process is killed.
        assert verifier.score("\\boxed{9^{9^{9^{9}}}}", "3") == (0.0, {"correct": 0.0, "format": 1.0,
                                                                     "gold_unparsable": 0.0, "timeout": 1.0})
        assert verifier.score("\\boxed{3}", "3")[0] == 1.0
        clone = pickle.loads(pickle.dumps(verifier))
        assert clone.score("\\boxed{3}", "3")[0] == 1.0
        clone.close()
    finally:
        verifier.close()


def test_score_many_equals_scoring_one_by_one(gsm8k):
    """A hand-back's completions scored together by 3 math_verify workers (answers shared within a group checked
    once): the same rewards and components as one by one; a hanging answer times out alone."""
    problems = [gsm8k.to_problem(gsm8k.rows[i], i) for i in range(4)]
    texts = [f"so it is \\boxed{{{p.gold}}}" for p in problems] + ["the answer is 7", "no answer", "\\boxed{x}"]
    golds = [p.gold for p in problems] + [problems[0].gold] * 3
    texts, golds = texts * 2, golds * 2  # repeated answers
    verifier = MathVerifier(timeout_s=5.0, workers=3)
    try:
        many = verifier.score_many(texts, golds)
        assert many == [verifier.score(t, g) for t, g in zip(texts, golds)]
        assert [r for r, _ in many[:4]] == [1.0] * 4 and many[4][0] == many[5][0] == 0.0
    finally:
        verifier.close()
    short = MathVerifier(timeout_s=1.0, workers=2)
    try:
        hang = short.score_many(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{3}"], ["3", "3"])
        assert hang[0][1]["timeout"] == 1.0 and hang[1] == (1.0, {"correct": 1.0, "format": 1.0,
                                                                 "gold_unparsable": 0.0, "timeout": 0.0})
    finally:
        short.close()


def test_math_verify_timeout_warning_is_not_logged():
    """math_verify logs "Timeout is disabled ..." once per process when its timeouts are off, as every call
    of ours turns them off: neither the calling process nor the worker child may print it."""
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from distrl.rollout.rewards import MathVerifier, normalize_answer\n"
            "for t in (None, 5.0):\n"
            "    v = MathVerifier(timeout_s=t); print(v.score('\\\\boxed{1/2}', '0.5')[0]); v.close()\n"
            "print(normalize_answer('0.5'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1.0", "1.0", "1/2"], proc.stdout
    assert "Timeout is disabled" not in proc.stdout + proc.stderr


def test_final_answer():  # more in test_final_answer.py
    assert final_answer("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}} c 7") == "x^{2}"
    assert final_answer("costs $1,234.50 and 7 more, total -3.5") == "-3.5"
    assert final_answer("total 1,234,567") == "1234567"
    assert final_answer("nothing \\boxed{unclosed") is None


# ---- load_task -----------------------------------------------------------------------------------------

def test_load_task_infers_from_jsonl_fields():
    task = load_task(None, str(GSM8K), seed=0)
    assert isinstance(task, GSM8KTask) and len(task.rows) == 7473
    task = load_task(None, str(MATH500), seed=0)
    assert isinstance(task, MATH500Task) and len(task.rows) == 500
    assert next(task.problems(0)).prompt_id.startswith("test/")


def test_load_task_parquet_and_explicit_task(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist(read_rows(MATH500, 10)), path)
    assert isinstance(load_task(None, str(path), 0), MATH500Task)
    assert isinstance(load_task("math500", str(path), 0), MATH500Task)
    with pytest.raises(ValueError, match="gsm8k needs fields"):
        load_task("gsm8k", str(path), 0)


def test_load_task_unknown_fields_names_them(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"prompt": "2+2", "target": "4"}\n')
    with pytest.raises(ValueError, match=r"\['prompt', 'target'\]"):
        load_task(None, str(path), 0)
    with pytest.raises(ValueError, match="local files must be"):
        (tmp_path / "rows.csv").write_text("a,b\n")
        load_task(None, str(tmp_path / "rows.csv"), 0)


def test_load_task_builtin_tasks():
    assert type(load_task(None, None, 0)) is ArithTask
    assert type(load_task("arith", None, 0)) is ArithTask
    assert type(load_task("half_vocab", str(GSM8K), 0)) is HalfVocabTask  # dataset ignored
    with pytest.raises(ValueError, match="unknown task"):
        load_task("chess", None, 0)


def test_dataset_stream_is_seeded_and_epochal():
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(6)]
    task = GSM8KTask(rows, verify_timeout_s=None)
    take = lambda seed, n: [p.prompt_id for p in itertools.islice(task.problems(seed), n)]  # noqa: E731
    first = take(0, 12)
    assert sorted(first[:6]) == sorted(first[6:]) == sorted(f"gsm8k:{i}" for i in range(6))  # each epoch once
    assert first[:6] != first[6:]  # reshuffled
    assert take(0, 12) == first and take(1, 12) != first
    assert take(0, 12) != [p.prompt_id for p in itertools.islice(GSM8KTask(rows, base_seed=1).problems(0), 12)]


# ---- arith and half_vocab ------------------------------------------------------------------------------

def test_arith_problems_deterministic_per_seed_and_correct():
    task = ArithTask()
    a = list(itertools.islice(task.problems(0), 50))
    assert a == list(itertools.islice(ArithTask().problems(0), 50))
    assert a != list(itertools.islice(task.problems(1), 50))
    for p in a:
        x, op, y = p.meta["a"], p.meta["op"], p.meta["b"]
        assert 0 <= x <= 99 and 0 <= y <= 99 and op in "+-"
        assert p.question == f"{x}{op}{y}=" and int(p.gold) == eval(f"{x}{op}{y}")
    assert {p.meta["op"] for p in itertools.islice(ArithTask(ops=("*",), max_operand=9).problems(0), 20)} == {"*"}
    with pytest.raises(ValueError, match="ops"):
        ArithTask(ops=("/",))


def test_arith_prompt_fits_the_tiny_character_tokenizer():
    from distrl.core.tiny import build_tokenizer

    tok = build_tokenizer()
    assert not tok.chat_template
    for p in itertools.islice(ArithTask(ops=("+", "-", "*")).problems(3), 50):
        prompt = ArithTask().prompt(p, tok)
        assert prompt == p.question and set(prompt) <= set("0123456789+-*= ")
        assert tok.unk_token_id not in tok(prompt)["input_ids"]


def test_arith_reward_final_answer():
    p = Problem("arith:37+45=", "37+45=", "82")
    assert ArithTask().reward("82", [], p) == (1.0, {"correct": 1.0, "format": 0.0})
    assert ArithTask().reward("37+45=82", [], p)[0] == 1.0  # the last number, not the question's
    assert ArithTask().reward(" 82 7", [], p)[0] == 0.0
    assert ArithTask().reward("82.0", [], p)[0] == 1.0 and ArithTask().reward("82.5", [], p)[0] == 0.0
    assert ArithTask().reward("81", [], p)[0] == 0.0
    assert ArithTask().reward("8 2", [], p)[0] == 0.0
    assert ArithTask().reward("", [], p)[0] == 0.0
    assert ArithTask().reward("37+45 = \\boxed{82}", [], p) == (1.0, {"correct": 1.0, "format": 1.0})
    assert ArithTask().reward("-33", [], Problem("x", "12-45=", "-33"))[0] == 1.0


def test_half_vocab_reward():
    p = next(HalfVocabTask().problems(0))
    assert HalfVocabTask().reward("", [0, 2, 3, 5], p) == (0.5, {"in_half": 0.5})
    assert HalfVocabTask().reward("", [4, 6], p) == (1.0, {"in_half": 1.0})
    assert HalfVocabTask().reward("", [], p) == (0.0, {"in_half": 0.0})


# ---- prompts ------------------------------------------------------------------------------------------

def test_prompts_with_qwen_chat_template(gsm8k, math500):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QWEN))
    for task in (gsm8k, math500, ArithTask(), HalfVocabTask()):
        p = next(task.problems(0))
        prompt = task.prompt(p, tok)
        assert prompt.startswith("<|im_start|>system\n") and "\\boxed{}" in prompt
        assert f"<|im_start|>user\n{p.question}<|im_end|>\n" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")


def test_plain_prompt_without_chat_template(math500):
    p = next(math500.problems(0))
    prompt = math500.prompt(p, None)
    assert p.question in prompt and "\\boxed{}" in prompt and prompt.endswith("Answer:")
