"""A learner's preflight: what it needs, checked before torch loads a model or a run directory exists.

The model it trains and the tokenizer it exports with resolve without a download and fit each other
(`distrl.core.hub`). Each failure is a :class:`distrl.core.errors.PreflightError` naming the flag;
`distrl/cmd/preflight.py` composes the role checks per command, docs/troubleshooting.md lists them.
"""

from __future__ import annotations

from distrl.core.hub import check_model, check_tokenizer, check_vocab_fits
from distrl.core.run_options import SharedOptions


def check(shared: SharedOptions) -> None:
    """`distrl learn` (and the learners of `distrl train`): `--model` and `--tokenizer` (the shared section)."""
    check_model(shared.model)
    check_tokenizer(shared.tokenizer)
    check_vocab_fits(shared.model, shared.tokenizer)
