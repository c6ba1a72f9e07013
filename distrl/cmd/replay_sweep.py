"""`distrl replay SOURCE --sweep FLAG=V1,V2,...`: the same logged stream replayed once per value of one flag,
then one table and one plot of held-out accuracy by version per value.

Each value runs :func:`distrl.cmd.replay.replay` with the sweep's other flags and ``--FLAG V`` into
``<log_dir>/<run_name>/<FLAG>-<V>/``: the very config a plain ``distrl replay SOURCE --FLAG V`` builds (only its
``--run_name`` and ``--log_dir`` differ), so a value's numbers are that replay's. Every replay evaluates version
0 and each version it trained (every ``--eval_every``-th and the last, if given) on ``--eval_size`` held-out
problems (32 when unset): greedy pass@1 with the ``hf`` engine. Then ``<log_dir>/<run_name>/`` gets:

- ``sweep.json``: ``{"flag", "values", "eval_size", "runs": {V: {"run_dir", "versions", "heldout_versions",
  "heldout_accuracy_by_version", "staleness_max_by_version", "wall_s"}}}``;
- ``sweep.md`` (markdown) and ``sweep.csv``: one row per evaluated version, one accuracy column per value;
- ``sweep.png``: accuracy against version, one line per value (matplotlib, Agg backend).

The logged reward by version (each replay's ``summary.json``) is the source run's, earned by the policy that
generated the log, not by the replay's: the table shows held-out accuracy only.

Sweepable flags: those a replay overrides (:data:`distrl.cmd.sweep_spec.SWEEPABLE`). A bad spec raises
ValueError naming the flag or value while the flags are parsed (exit 2, nothing written). `distrl replay`
runs :func:`replay_or_sweep`.
"""

from __future__ import annotations

import json
from pathlib import Path

from distrl.cmd.replay import replay
from distrl.cmd.sweep_spec import value_configs


def replay_or_sweep(cfg) -> dict:
    """`distrl replay`: :func:`run_sweep` with ``--sweep``, else one :func:`distrl.cmd.replay.replay`; returns
    its result."""
    return replay(cfg) if cfg.sweep is None else run_sweep(cfg)


def run_sweep(cfg) -> dict:
    """Replay ``cfg.source`` once per value of ``cfg.sweep``; write the table and plot (module docstring).

    Returns the content of ``sweep.json``. Raises FileExistsError if ``cfg.out_dir`` exists, and what a
    replay raises."""
    out = cfg.out_dir
    if out.exists():
        raise FileExistsError(f"sweep directory {out} exists: pick another --run_name or remove it")
    runs = value_configs(cfg)
    flag = cfg.sweep.partition("=")[0].strip().removeprefix("--")
    out.mkdir(parents=True)
    result = {"flag": flag, "values": [t for t, _ in runs], "eval_size": runs[0][1].eval_size, "runs": {}}
    for text, value_cfg in runs:
        print(f"distrl replay --sweep: {flag}={text} -> {value_cfg.out_dir}", flush=True)
        summary = replay(value_cfg)
        result["runs"][text] = {k: summary[k] for k in ("run_dir", "versions", "heldout_versions",
                                                         "heldout_accuracy_by_version", "staleness_max_by_version",
                                                         "wall_s")}
    (out / "sweep.json").write_text(json.dumps(result, indent=2))
    table = write_table(out, result)
    plotted = plot(out, result)
    print(f"\n{table}\ndistrl replay --sweep: wrote {out}/sweep.md, sweep.csv, sweep.json"
          + (", sweep.png" if plotted else " (no plot: matplotlib is not installed)"))
    return result


def write_table(out: Path, result: dict) -> str:
    """``sweep.md`` and ``sweep.csv`` in ``out``: held-out accuracy (pass@1, 0-1) by evaluated version (rows)
    and value (columns), blank where a value did not evaluate that version. Returns the markdown."""
    runs, flag = result["runs"], result["flag"]
    by_value = [dict(zip(r["heldout_versions"], r["heldout_accuracy_by_version"])) for r in runs.values()]
    header = ["version", *(f"{flag}={v}" for v in runs)]
    rows = [[str(v), *(f"{a[v]:.4f}" if v in a else "" for a in by_value)]
            for v in sorted(set().union(*by_value))]
    (out / "sweep.csv").write_text("\n".join(",".join(row) for row in [header, *rows]) + "\n")
    lines = [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}", *(f"| {' | '.join(row)} |" for row in rows)]
    text = (f"Held-out accuracy (greedy pass@1 on {result['eval_size']} problems) by replayed version, per "
            f"--{flag}\n\n" + "\n".join(lines) + "\n")
    (out / "sweep.md").write_text(text)
    return text


def plot(out: Path, result: dict) -> Path | None:
    """``sweep.png`` in ``out``: held-out accuracy against version, one line per value; None (nothing
    written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for value, run in result["runs"].items():
        ax.plot(run["heldout_versions"], run["heldout_accuracy_by_version"], marker="o",
                label=f"{result['flag']}={value}")
    ax.set(xlabel="policy version (replayed)", ylabel=f"held-out accuracy ({result['eval_size']} problems)",
           title=f"distrl replay --sweep {result['flag']}", ylim=(-0.02, 1.02))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=100)
    plt.close(fig)
    return out / "sweep.png"
