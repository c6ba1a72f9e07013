"""A reward with an interior optimum for the embedded tiny model: bench/adaptive_staleness.py's divergence setting.

`half_vocab` rewards the share of even token ids, so any collapse toward even ids scores the maximum and a stale,
overshooting learner is never punished. Here the reward peaks when 70 % of the completion's token ids are even
and falls on both sides: ``max(1 - 4 * |f - 0.7|, -0.5)`` (f = share of even ids; about 0.1 for the random
policy's f ~ 0.47). Below f = 0.325 or above f = 1.075 (never) the reward is flat at -0.5: like a verifiable task's
0/1 reward, a policy that has collapsed far from the target gets no signal back (every completion of a group
scores the same, the advantages vanish), so a learner whose stale, overshooting updates collapse it stays there.

The tiny model's tokenizer is one token per character (distrl/core/tiny.py), so the ids are read off the text.
"""

from __future__ import annotations

from distrl.core.tiny import CHARS, SPECIALS

TARGET = 0.7
FLOOR = -0.5
_ID = {c: len(SPECIALS) + i for i, c in enumerate(CHARS)}


def reward(completion_text: str, problem) -> tuple[float, dict[str, float]]:
    """``max(1 - 4 * |f - 0.7|, -0.5)`` with f the share of even token ids of ``completion_text`` (0 when empty)."""
    ids = [_ID[c] for c in completion_text if c in _ID]
    f = sum(1 for i in ids if i % 2 == 0) / len(ids) if ids else 0.0
    return max(1.0 - 4.0 * abs(f - TARGET), FLOOR), {"even_share": f}
