"""A learner's preflight: what it needs, checked before torch loads a model or a run directory exists.

The model it trains and the tokenizer it exports with resolve without a download and fit each other
(`distrl.core.hub`). Each failure is a :class:`distrl.core.errors.PreflightError` naming the flag;
`distrl/cmd/preflight.py` composes the role checks per command, docs/troubleshooting.md lists them.
"""

from __future__ import annotations

from distrl.core.hub import check_model, check_tokenizer, check_vocab_fits


def check(cfg) -> None:
    """`distrl learn` (and the learners of `distrl train`): `--model` and `--tokenizer` of a TrainConfig."""
    check_model(cfg.model)
    check_tokenizer(cfg.tokenizer)
    check_vocab_fits(cfg.model, cfg.tokenizer)
