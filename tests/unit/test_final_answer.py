"""The final-answer rule (distrl.rollout.answers) on completions written the way real models write them.

Most samples are SmolLM2-135M-Instruct's own style (issue 19): it restates the sum (``34 + 79 = 113``),
explains first ("To solve this problem, ..."), or states the answer in words. Each case gives the expected
answer by hand.
"""

from __future__ import annotations

import pytest

from distrl.rollout.answers import final_answer, final_number, integer_answer, normalize_text
from distrl.rollout.tasks import ArithTask, GSM8KTask, MATH500Task, Problem

SMOLLM2_RAMBLE = ("To solve this problem, we need to find the sum of 34 and 79. 34 + 79 = 113. "
                  "So the answer is 113.")

# (completion, final_answer, integer_answer)
CASES = [
    ("34 + 79 = 113", "113", 113),  # the question's numbers come first
    ("The answer is 113.", "113", 113),  # trailing period
    ("\\boxed{113}", "113", 113),
    (SMOLLM2_RAMBLE, "113", 113),
    ("113 apples", "113", 113),  # a unit
    ("$1,130", "1130", 1130),  # currency and thousands separator
    ("-5", "-5", -5),
    ("Answer: 42\n", "42", 42),
    ("the answer is: 42", "42", 42),
    ("**Answer:** 42", "42", 42),
    ("The answer is 113 apples, because 34 + 79 = 113 and 5 are left.", "113", 113),
    ("What is 12 + 5? 17", "17", 17),  # the question repeated, then the answer
    ("\\boxed{113}. Check: 34 + 79 = 113, and 113 - 79 = 34, plus 7.", "113", 113),  # text after the box
    ("So \\boxed{34 + 79 = 113}", "34 + 79 = 113", 113),  # the last number inside the box
    ("Answer: The sum of 34 and 79 is 113", "The sum of 34 and 79 is 113", 113),
    ("The answer is below:\n113", "113", 113),  # "below" states no answer: the last number
    ("no number here", None, None),
    ("To solve this problem, we need to find the sum of 34 and", "34", 34),  # cut mid-way: its last number
    ("The answer is \\boxed{11", "\\boxed{11", 11),  # cut inside the box: no complete box
    ("113.0", "113.0", 113),  # integral
    ("113.5", "113.5", None),  # not an integer
    ("12-5=7", "7", 7),  # a minus between numbers is no sign
    ("x = -5.", "-5", -5),
    ("The total is $18.00.", "18.00", 18),
    ("The answer is $\\frac{1}{2}$.", "\\frac{1}{2}", 2),  # a math answer for math_verify; its last number
]


@pytest.mark.parametrize("completion,answer,integer", CASES)
def test_real_model_completions(completion, answer, integer):
    assert final_answer(completion) == answer
    assert integer_answer(completion) == integer


def test_final_number_is_the_last_number_of_the_final_answer():
    assert final_number("Answer: 1,234.50 dollars") == "1234.50"
    assert final_number("\\boxed{x = 3.5}") == "3.5"
    assert final_number("\\boxed{\\text{(C)}}") is None
    assert final_number("") is None


@pytest.mark.parametrize("completion,integer", [(c, i) for c, _, i in CASES])
def test_arith_reward_and_eval_answer_follow_the_rule(completion, integer):
    task = ArithTask()
    correct = Problem("x", "q", "113")
    expected = float(integer == 113)
    assert task.reward(completion, [], correct)[0] == expected
    assert task.extract_answer(completion) == (None if integer is None else str(integer))


def test_tiny_model_style_still_scores():
    p = Problem("arith:37+45=", "37+45=", "82")
    assert ArithTask().reward("82", [], p)[0] == 1.0
    assert ArithTask().reward("81", [], p)[0] == 0.0


@pytest.mark.parametrize("completion,expected", [
    ("Janet has 16 - 3 - 4 = 9 eggs. She makes 9 * 2 = $18 every day.", 1.0),  # the last number
    ("She makes 9 * 2 = 18 dollars. The answer is 18.", 1.0),
    ("The answer is $18.00 per day.", 1.0),  # unit and decimals
    ("The answer is 18 dollars, from 9 eggs at 2 each.", 1.0),
    ("She makes \\boxed{18} dollars, 2 per egg.", 1.0),
    ("Answer: 18 dollars. Tomorrow she sells 10 eggs, 20 dollars.", 1.0),  # stated answer over last number
    ("The answer is 18.5", 0.0),
])
def test_gsm8k_grades_by_the_same_rule(completion, expected):
    task = GSM8KTask([{"question": "q", "answer": "... #### 18"}], verify_timeout_s=None)
    assert task.reward(completion, [], next(task.problems(0)))[0] == expected


# Unicode signs and digits (issue 40): each written form of -23, as a completion and as a gold, in every grader.
MINUS_23 = ["-23", "\u221223", "\u201223", "\u201323", "\u201423", "\u201523", "\uff0d\uff12\uff13", "\ufe6323",
            "-\u0662\u0663", "-\u0968\u0969"]  # ... Arabic-Indic and Devanagari digits


@pytest.mark.parametrize("written", MINUS_23)
def test_unicode_minus_and_digits_read_as_ascii(written):
    assert normalize_text(written) == "-23"
    assert final_answer(f"So the answer is \\boxed{{{written}}}.") == "-23"
    assert integer_answer(f"The answer is {written}.") == -23


def test_normalize_text_keeps_exponents_and_leaves_ascii_alone():
    assert normalize_text("x\u00b2 + 10\u207b\u00b3") == "x^{2} + 10^{-3}"  # NFKC alone gives "x2 + 10-3"
    assert normalize_text("a\u2081") == "a_{1}"
    assert normalize_text("\u00bd") == "1/2"
    assert normalize_text("12-5 = 7, \\frac{1}{2}") == "12-5 = 7, \\frac{1}{2}"
    assert normalize_text("12\u22125") == "12-5"  # still a minus between numbers, no sign
    assert integer_answer("12\u22125=7") == 7


@pytest.mark.parametrize("gold", ["-23", "\u221223", "\uff0d\uff12\uff13"])
@pytest.mark.parametrize("written", ["-23", "\u221223", "\u201323", "\uff0d\uff12\uff13", "-\u0662\u0663"])
def test_every_builtin_grader_reads_unicode_minus(gold, written):
    problem = Problem("x", "q", gold)
    assert ArithTask().reward(f"\\boxed{{{written}}}", [], problem)[0] == 1.0
    assert ArithTask().reward(f"\\boxed{{{written}}}", [], Problem("x", "q", "23"))[0] == 0.0
    assert ArithTask().extract_answer(written) == "-23"
    gsm8k = GSM8KTask([{"question": "q", "answer": f"... #### {gold}"}], verify_timeout_s=None)
    assert gsm8k.reward(f"The answer is {written}.", [], next(gsm8k.problems(0)))[0] == 1.0
    assert gsm8k.reward("The answer is 23.", [], next(gsm8k.problems(0)))[0] == 0.0
    math500 = MATH500Task([{"problem": "q", "answer": gold}], verify_timeout_s=None)
    assert math500.reward(f"\\boxed{{{written}}}", [], next(math500.problems(0)))[0] == 1.0
    assert math500.extract_answer(f"\\boxed{{{written}}}") == "-23"


def test_unicode_answers_through_the_math_verify_workers():
    task = MATH500Task([{"problem": "q", "answer": "\\frac{1}{2}"}, {"problem": "r", "answer": "x^{2}"}],
                       verify_timeout_s=30.0)
    try:
        half, square = (task.to_problem(task.rows[i], i) for i in range(2))
        assert [r for r, _ in task.rewards([("\\boxed{\u00bd}", [], half), ("\\boxed{x\u00b2}", [], square),
                                            ("\\boxed{x2}", [], square)])] == [1.0, 1.0, 0.0]
    finally:
        task.verifier.close()
