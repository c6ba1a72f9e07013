"""Final answers: where a completion states its answer, read the way real models state it.

One rule, used by every reward and by evaluation (`distrl.rollout.rewards`, `distrl.rollout.tasks`, `distrl eval`):

=====  ==========================================================  =================================
step   the final answer is                                          example -> answer
=====  ==========================================================  =================================
1      the content of the last complete ``\\boxed{...}``            ``... \\boxed{113}. Then 5`` -> ``113``
2      the last explicit statement: ``answer is X``, ``Answer: X``,  ``So the answer is 113.`` -> ``113``
       ``the answer is: X``, ``**Answer:** X`` (any case); X runs   ``Answer: 113 apples`` -> ``113``
       to the end of its line or sentence, without ``*``, ``$``    ``The answer is $\\frac{1}{2}$.`` ->
       and a trailing period; a number followed by words (units)   ``\\frac{1}{2}``
       is that number; X counts only if it holds a digit or a
       ``\\`` (``The answer is below`` does not)
3      the last number of the completion                            ``34 + 79 = 113`` -> ``113``
=====  ==========================================================  =================================

Numbers (:data:`NUMBER`): an optional minus sign (not after a letter, digit or closing bracket, so
``12-5`` is 12 and 5), thousands separators (``1,130`` -> ``1130``), decimals (``3.5``); a trailing period
is not part of one (``113.`` -> ``113``). :func:`final_number` is the last number of the final answer,
:func:`integer_answer` that number when it is integral (``113.0`` -> 113, ``113.5`` -> None).

Unicode (:func:`normalize_text`, applied to the completion by :func:`final_answer` and to gold and answer by
every built-in grader in `distrl.rollout.rewards`): NFKC (fullwidth ``－２３`` -> ``-23``), the minus sign
U+2212 and the dashes U+2010-2015 read as ``-``, any script's decimal digits as ASCII (``٢٣`` -> ``23``),
superscripts and subscripts kept as exponents and indices (``x²`` -> ``x^{2}``, not ``x2``).
"""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# 1,234,567.5 | 1234.5 | .5, each with an optional minus sign that does not follow a letter, digit or bracket.
NUMBER = r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(NUMBER)
_ANSWER_IS = re.compile(r"\banswer\b[\s*]*(?:is\b|:)[\s*:]*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_NUMBER_WITH_UNIT = re.compile(rf"({NUMBER})(?=\s*%|,?\s+[A-Za-z(]|$)")
# Read as "-" after NFKC: hyphen, non-breaking hyphen, figure/en/em dash, horizontal bar, minus sign, heavy
# minus, small em dash; U+2044 (NFKC's fraction slash: "½" -> "1⁄2") as "/".
_AS_ASCII = {**dict.fromkeys(map(ord, "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\u2796\ufe58"), "-"), 0x2044: "/"}
_SUPERSCRIPTS = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u207b]+")  # ⁰¹²³⁴-⁹ ⁺ ⁻
_SUBSCRIPTS = re.compile("[\u2080-\u208b]+")  # ₀-₉ ₊ ₋
_NON_ASCII_DIGIT = re.compile(r"(?![0-9])\d")  # a decimal digit (Unicode category Nd) of another script


def normalize_text(text: str) -> str:
    """`text` with the unicode forms of digits and signs written in ASCII (see the module docstring):
    ``"−23"`` (U+2212), ``"–23"`` (en dash) and ``"－２３"`` (fullwidth) -> ``"-23"``, ``"٢٣"`` -> ``"23"``,
    ``"x²"`` -> ``"x^{2}"``. ASCII text is returned unchanged."""
    if text.isascii():
        return text
    text = _SUPERSCRIPTS.sub(lambda m: "^{" + m.group() + "}", text)  # before NFKC, which makes ² a plain 2
    text = _SUBSCRIPTS.sub(lambda m: "_{" + m.group() + "}", text)
    text = unicodedata.normalize("NFKC", text).translate(_AS_ASCII)
    return _NON_ASCII_DIGIT.sub(lambda m: str(unicodedata.decimal(m.group())), text)


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, braces matched; else None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def last_number(text: str) -> str | None:
    """The last number in `text` (:data:`NUMBER`), thousands separators removed (``"1,234.5"`` -> ``"1234.5"``)."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def stated_answer(text: str) -> str | None:
    """X of the last ``answer is X`` / ``Answer: X`` in `text` (step 2 of the module's rule); None when
    there is none or X holds neither a digit nor a ``\\``."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    span = text[matches[-1].end():].split("\n", 1)[0]
    span = _SENTENCE_END.split(span, maxsplit=1)[0]
    span = re.sub(r"\\?\$|\*", "", span).strip().rstrip(".").strip()
    if not re.search(r"[\d\\]", span):
        return None
    with_unit = _NUMBER_WITH_UNIT.match(span)
    return with_unit.group(1).replace(",", "") if with_unit else span


def final_answer(text: str) -> str | None:
    """The completion's final answer (the module's rule): the last ``\\boxed{}`` content, else the last
    stated ``answer is X``, else the last number; None when there is none of them. `text` is read through
    :func:`normalize_text` first."""
    text = normalize_text(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    stated = stated_answer(text)
    return stated if stated is not None else last_number(text)


def final_number(text: str) -> str | None:
    """The last number of :func:`final_answer` (``"34 + 79 = 113"`` -> ``"113"``), without thousands
    separators; None when the final answer holds no number."""
    answer = final_answer(text)
    return None if answer is None else last_number(answer)


def integer_answer(text: str) -> int | None:
    """:func:`final_number` as an int when it is integral (``"113.0"`` -> 113); None when it is not
    (``"113.5"``) or there is none."""
    number = final_number(text)
    if number is None:
        return None
    value = Decimal(number)
    return int(value) if value == value.to_integral_value() else None
