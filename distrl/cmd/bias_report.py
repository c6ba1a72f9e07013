"""The end-of-run report's sampling-bias section, from the buffer's final counters (``summary["buffer"]["bias"]``,
:meth:`distrl.buffer.bias.BiasMonitor.summary`; nothing new is logged for it).

:func:`bias_numbers` gives the report's one-line numbers (``bias_len_gap`` tokens, ``bias_difficulty_gap`` mean
reward, ``bias_lag_mean`` versions, ``bias_untrained_share`` fraction; None for a run whose buffer did not count);
:func:`bias_markdown` the per-version table written to ``<run_dir>/bias.md``: per policy version, prompts issued and,
for the groups generated, trained and evicted, their count, mean length (model tokens), mean reward and lag.
"""

from __future__ import annotations

from pathlib import Path

KEYS = ("len_gap", "difficulty_gap", "lag_mean", "untrained_share")


def bias_of(summary: dict) -> dict | None:
    """The monitor's summary in the driver's summary dict, or None."""
    return (summary.get("buffer") or {}).get("bias")


def bias_numbers(summary: dict) -> dict:
    """``{"bias_<key>": value}`` for KEYS (None when not counted)."""
    bias = bias_of(summary) or {}
    return {f"bias_{key}": bias.get(key) for key in KEYS}


def _cell(stage: dict) -> str:
    if not stage["groups"]:
        return "0 | - | - | -"
    return f"{stage['groups']} | {stage['length']:.1f} | {stage['difficulty']:.3f} | {stage['lag']:.2f}"


def bias_markdown(bias: dict) -> str:
    """The per-version table (markdown) with the run's gaps above it."""
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = ["# Sampling bias (distrl.buffer.bias)", "",
             f"Trained minus generated: length gap **{fmt(bias['len_gap'], '+.2f')}** tokens, difficulty (mean "
             f"reward) gap **{fmt(bias['difficulty_gap'], '+.3f')}**; mean lag of trained groups "
             f"{fmt(bias['lag_mean'], '.2f')} versions; {bias['issued']} prompts issued, "
             f"{fmt(bias['untrained_share'], '.1%')} never trained.", "",
             "| version | issued | generated | len | reward | lag | trained | len | reward | lag "
             "| evicted | len | reward | lag |", "|" + "---|" * 14]
    for row in bias["by_version"]:
        lines.append(f"| {row['version']} | {row['issued']} | {_cell(row['generated'])} | {_cell(row['trained'])} "
                     f"| {_cell(row['evicted'])} |")
    return "\n".join(lines) + "\n"


def write_bias(run_dir: str | Path, summary: dict) -> str | None:
    """Write ``<run_dir>/bias.md``; returns its path (None when the buffer did not count)."""
    bias = bias_of(summary)
    if not bias:
        return None
    path = Path(run_dir) / "bias.md"
    path.write_text(bias_markdown(bias))
    return str(path)
