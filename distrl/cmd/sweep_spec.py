"""The spec of `distrl replay --sweep FLAG=V1,V2,...` (:mod:`distrl.cmd.replay_sweep` runs it): which flags a sweep
takes, each value typed as its flag, and each value's own replay config; checked while the flags are parsed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from distrl.buffer.config import SelectionOptions
from distrl.cmd.compose import flat_hints

SWEEPABLE = ("batch_size", "topk", "max_staleness", "staleness_model", "learner", "learning_rate", "seed",
             "max_steps", *(f.name for f in dataclasses.fields(SelectionOptions)
                            if f.name not in ("credit_timeout_s", "max_filtered_groups")),  # no actors, no filter run
             # distrl.cmd.config_offline.ReplayLossOptions (not imported: it imports this module)
             "clip_eps", "clip_eps_low", "clip_eps_high", "kl_coef", "off_policy", "is_cap", "is_level", "is_mask_low",
             "is_mask_high")
DEFAULT_EVAL_SIZE = 32  # held-out problems a sweep evaluates each version on when --eval_size is unset


def _convert(flag: str, text: str, hint) -> object:
    """``text`` as a value of a flag of type ``hint`` (int, float, bool, a Literal, or Optional of one).

    Raises ValueError naming the flag and the value."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        if text not in typing.get_args(hint):
            raise ValueError(f"--sweep {flag}: {text!r} is not one of {', '.join(map(str, typing.get_args(hint)))}")
        return text
    if hint is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--sweep {flag}: {text!r} is not True or False")
        return text.lower() == "true"
    try:
        value = hint(text)
    except ValueError:
        raise ValueError(f"--sweep {flag}: {text!r} is not a{'n' if hint is int else ''} {hint.__name__}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"--sweep {flag}: {text!r} is not a finite number")
    return value


def parse_sweep(spec: str, config_cls: type) -> tuple[str, list[str], list[object]]:
    """``FLAG=V1,V2,...`` -> ``(flag, texts, values)``, each value typed as ``config_cls``'s flag.

    Raises ValueError: no ``=``, a flag replay has not, one it cannot sweep, no value, an empty or repeated
    value, or a value of the wrong type."""
    flag, sep, values = spec.partition("=")
    flag = flag.strip().removeprefix("--")
    if not sep:
        raise ValueError(f"--sweep {spec!r}: give FLAG=V1,V2,... (e.g. max_staleness=0,1,2,4)")
    hints = flat_hints(config_cls)
    if flag not in hints:
        raise ValueError(f"--sweep {spec!r}: distrl replay has no flag --{flag}")
    if flag not in SWEEPABLE:
        raise ValueError(f"--sweep {spec!r}: --{flag} is not one a replay can sweep (it can: "
                         f"{', '.join(SWEEPABLE)})")
    texts = [t.strip() for t in values.split(",")]
    if not values.strip() or any(not t for t in texts):
        raise ValueError(f"--sweep {spec!r}: --{flag} needs values, comma-separated, none empty")
    if len(set(texts)) < len(texts):
        raise ValueError(f"--sweep {spec!r}: --{flag} has a value twice")
    return flag, texts, [_convert(flag, t, hints[flag]) for t in texts]


def value_configs(cfg) -> list[tuple[str, object]]:
    """``(value text, ReplayConfig)`` for each value of ``cfg.sweep``: ``cfg`` with ``--FLAG value``, no sweep,
    its own run directory under ``cfg.out_dir``. Raises ValueError (a bad spec, or a value the replay's own
    checks refuse, named)."""
    flag, texts, values = parse_sweep(cfg.sweep, type(cfg))
    if cfg.eval_size == 0:
        raise ValueError("--sweep with --eval_size 0: the sweep's table is held-out accuracy; give --eval_size N")
    base = {**cfg.to_flat(), "sweep": None, "log_dir": str(cfg.out_dir),
            "eval_size": cfg.eval_size or DEFAULT_EVAL_SIZE}
    out = []
    for text, value in zip(texts, values):
        try:
            out.append((text, type(cfg)(**{**base, flag: value, "run_name": f"{flag}-{text}"})))
        except ValueError as exc:
            raise ValueError(f"--sweep {flag}={text}: {exc}") from None
    return out
