"""End-of-run report of `distrl train`: learning-curve PNG, a summary table, and one JSON line.

Sources, all written by the roles during the run (nothing new is logged for the report):

- the learners' TensorBoard events (``<run_dir>/tb/learner0``, read with tensorboard's
  ``EventAccumulator``): ``learner/reward_mean``, ``learner/staleness_mean``/``_max`` and
  ``learner/tokens_per_s`` per policy version; the actors' ``actor/tokens_per_s`` (``tb/actor<i>``);
- ``<run_dir>/eval.jsonl`` (``--eval_every``): held-out accuracy per evaluated version;
- the driver's summary dict (versions, wall time, buffer counters), whose buffer counters hold the sampling-bias
  monitor's (:mod:`distrl.cmd.bias_report`: the ``bias_*`` numbers, a table row, and ``<run_dir>/bias.md``).

:func:`write_report` draws ``<run_dir>/curve.png`` (matplotlib, Agg backend: mean training reward
per policy version, and held-out accuracy), prints a table with rich, adds the report's numbers to
``summary.json`` and prints them as the LAST line of stdout, one JSON object::

    {"run_dir": ..., "versions": 120, "wall_s": 201.3, "accuracy_before": 0.27, "accuracy_after": 0.55,
     "reward_first": 0.21, "reward_last": 0.52, "curve_png": ".../curve.png",
     "tensorboard_dir": ".../tb", ...}

Accuracies are fractions in [0, 1] (None without ``--eval_every``): ``accuracy_before`` is the
evaluation at the smallest version (0: after any ``--warm_start_steps``, before RL), ``accuracy_after``
the one at the largest.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

from distrl.cmd.bias_report import bias_numbers, write_bias

LEARNER_TAGS = ("learner/reward_mean", "learner/staleness_mean", "learner/staleness_max", "learner/tokens_per_s")


def read_scalars(tb_dir: str | Path, tags: tuple[str, ...] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Scalars of the TensorBoard event files in `tb_dir`: tag -> [(step, value)] sorted by step.

    A step logged more than once keeps its last value. `tags` restricts the tags read (None: all).
    A missing directory gives {}.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(tb_dir).is_dir():
        return {}
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # not "No path found after ..." per file
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        if tags is None or tag in tags:
            by_step = {e.step: e.value for e in acc.Scalars(tag)}
            out[tag] = sorted(by_step.items())
    return out


def reward_series(run_dir: str | Path) -> list[tuple[int, float]]:
    """[(version, mean training reward)] of the whole run, from learner0's TensorBoard events: every event
    file under ``<run_dir>/tb/learner0``, a ``--resume``'s too (a version trained again after a resume
    keeps its last value). The summary's ``reward_by_version`` and the report's table both come from it."""
    return read_scalars(Path(run_dir) / "tb" / "learner0", ("learner/reward_mean",)).get("learner/reward_mean", [])


def read_eval(run_dir: str | Path) -> list[dict]:
    """The lines of ``<run_dir>/eval.jsonl`` sorted by version ([] without the file)."""
    path = Path(run_dir) / "eval.jsonl"
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(lines, key=lambda line: line["version"])


def _values(series: list[tuple[int, float]]) -> list[float]:
    return [v for _, v in series]


def report_numbers(run_dir: str | Path, summary: dict) -> tuple[dict[str, Any], list, list[dict]]:
    """The report's numbers from the run's files and the driver's `summary` (see the module docstring).

    Returns (numbers, the learner's [(version, mean reward)], the eval.jsonl lines).
    """
    run_dir = Path(run_dir)
    learner = read_scalars(run_dir / "tb" / "learner0", LEARNER_TAGS)
    actor_tps = [v for d in sorted((run_dir / "tb").glob("actor*"))
                 for v in _values(read_scalars(d, ("actor/tokens_per_s",)).get("actor/tokens_per_s", []))]
    series = learner.get("learner/reward_mean") or list(enumerate(summary.get("reward_by_version") or [], start=1))
    rewards = _values(series)
    evals = read_eval(run_dir)
    stale_mean, stale_max = _values(learner.get("learner/staleness_mean", [])), _values(
        learner.get("learner/staleness_max", []))
    learner_tps = _values(learner.get("learner/tokens_per_s", []))
    last = max(1, len(rewards) // 10)  # the last tenth of the run, for a less noisy end value
    return {
        "run_dir": str(run_dir), "versions": summary.get("versions"), "wall_s": summary.get("wall_s"),
        "train_wall_s": summary.get("train_wall_s"),
        "accuracy_before": evals[0]["accuracy"] if evals else None,
        "accuracy_after": evals[-1]["accuracy"] if evals else None,
        "eval_versions": [e["version"] for e in evals],
        "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
        "reward_last_tenth_mean": statistics.fmean(rewards[-last:]) if rewards else None,
        "staleness_mean": statistics.fmean(stale_mean) if stale_mean else None,
        "staleness_max": max(stale_max) if stale_max else None,
        "learner_tokens_per_s": statistics.fmean(learner_tps) if learner_tps else None,
        "actor_tokens_per_s": statistics.fmean(actor_tps) if actor_tps else None,
        "groups": (summary.get("buffer") or {}).get("groups_put"),
        "curve_png": str(run_dir / "curve.png"), "tensorboard_dir": str(run_dir / "tb"),
        "eval_jsonl": str(run_dir / "eval.jsonl") if evals else None,
        "summary_json": str(run_dir / "summary.json"), **bias_numbers(summary),
    }, series, evals


def plot_curve(path: str | Path, rewards: list[tuple[int, float]], evals: list[dict], title: str = "") -> Path:
    """Draw the learning curve to `path` (PNG): mean training reward per policy version (thin line,
    with a moving average over ~1/20 of the run) and held-out accuracy per evaluated version (markers).
    Both are fractions on one y axis [0, 1]. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if rewards:
        steps, values = zip(*rewards)
        ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=0.8, label="training reward (per version)")
        w = max(1, len(values) // 20)
        smooth = [statistics.fmean(values[max(0, i - w + 1):i + 1]) for i in range(len(values))]
        ax.plot(steps, smooth, color="tab:blue", linewidth=2, label=f"training reward (mean of {w})")
    if evals:
        ax.plot([e["version"] for e in evals], [e["accuracy"] for e in evals], "o-", color="tab:red",
                linewidth=2, label="held-out accuracy (greedy)")
    ax.set_xlabel("policy version")
    ax.set_ylabel("fraction")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if rewards or evals:
        ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(numbers: dict, file=None) -> None:
    """The report as a rich table (to `file`, default stdout; plain text when it is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="distrl run report", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    n = numbers
    rows = [
        ("policy versions", _fmt(n["versions"], "d")),
        ("wall time", f"{_fmt(n['wall_s'], '.1f')} s (roles: {_fmt(n['train_wall_s'], '.1f')} s)"),
        ("held-out accuracy", f"{_fmt(n['accuracy_before'])} -> {_fmt(n['accuracy_after'])} "
                              f"(versions {n['eval_versions'][0] if n['eval_versions'] else '-'} -> "
                              f"{n['eval_versions'][-1] if n['eval_versions'] else '-'})"),
        ("training reward", f"first {_fmt(n['reward_first'])}, last {_fmt(n['reward_last'])}, "
                            f"last tenth mean {_fmt(n['reward_last_tenth_mean'])}"),
        ("staleness", f"mean {_fmt(n['staleness_mean'], '.2f')}, max {_fmt(n['staleness_max'], '.0f')}"),
        ("tokens/s", f"learner {_fmt(n['learner_tokens_per_s'], '.0f')}, "
                     f"actors {_fmt(n['actor_tokens_per_s'], '.0f')}"),
        ("groups", _fmt(n["groups"], "d")),
        ("sampling bias", f"trained - generated: length {_fmt(n.get('bias_len_gap'), '+.2f')} tokens, reward "
                          f"{_fmt(n.get('bias_difficulty_gap'), '+.3f')}; lag {_fmt(n.get('bias_lag_mean'), '.2f')}; "
                          f"never trained {_fmt(n.get('bias_untrained_share'), '.3f')} (bias.md)"),
        ("curve", n["curve_png"]),
        ("TensorBoard", f"tensorboard --logdir {n['tensorboard_dir']}"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    Console(file=file or sys.stdout, width=max(100, len(n["curve_png"]) + 30)).print(table)


def write_report(run_dir: str | Path, summary: dict) -> dict:
    """Draw ``curve.png``, print the table, add the numbers to ``summary.json`` and print them as the last
    stdout line (one JSON object). Returns the numbers."""
    run_dir = Path(run_dir)
    numbers, rewards, evals = report_numbers(run_dir, summary)
    numbers["bias_md"] = write_bias(run_dir, summary)
    plot_curve(numbers["curve_png"], rewards, evals, title=run_dir.name)
    print_table(numbers)
    (run_dir / "summary.json").write_text(json.dumps({**summary, **numbers}, indent=2))
    sys.stdout.flush()
    print(json.dumps(numbers), flush=True)
    return numbers
