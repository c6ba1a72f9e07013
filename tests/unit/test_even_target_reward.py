"""bench/rewards/even_target.py: the divergence setting's reward peaks at 70 % even token ids and is flat far away."""

from __future__ import annotations

import pytest

from bench.rewards.even_target import reward
from distrl.core.tiny import build_tokenizer


def text_with_even_share(share: float, n: int = 20) -> str:
    """A completion of n tiny-model characters, round(share * n) of them with even token ids."""
    tok = build_tokenizer()
    chars = "0123456789abcdefghij"
    even = [c for c in chars if tok.convert_tokens_to_ids(c) % 2 == 0]
    odd = [c for c in chars if tok.convert_tokens_to_ids(c) % 2 == 1]
    k = round(share * n)
    return "".join(even[i % len(even)] for i in range(k)) + "".join(odd[i % len(odd)] for i in range(n - k))


@pytest.mark.parametrize("share,expected", [(0.7, 1.0), (0.5, 0.2), (1.0, -0.2), (0.3, -0.5), (0.0, -0.5)])
def test_reward_peaks_at_seventy_percent_and_has_a_floor(share, expected):
    value, components = reward(text_with_even_share(share), None)
    assert components["even_share"] == pytest.approx(share)
    assert value == pytest.approx(expected)


def test_empty_completion_scores_the_floor():
    assert reward("", None) == (-0.5, {"even_share": 0.0})
