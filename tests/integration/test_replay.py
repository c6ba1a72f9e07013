"""Acceptance: `distrl replay` trains a learner from the segment log of a real `distrl train` run, with no
actors, and its TensorBoard shows the replayed staleness — checked against the buffer's own selection
rules run on the same log (the pure GroupStore), for both staleness models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distrl.buffer.recovery import restore_store
from distrl.buffer.segments import lineage, read_consumed
from distrl.buffer.store import GroupStore
from tests.integration.test_train import ENV, ROOT


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    """A real 4-version `distrl train` run (tiny model, half_vocab task): its run directory."""
    log_dir = tmp_path_factory.mktemp("replay")
    proc = subprocess.run([sys.executable, "-m", "distrl", "train", "--model", "tiny", "--task", "half_vocab",
                           "--max_steps", "4", "--batch_size", "4", "--group_size", "4", "--max_new_tokens", "8",
                           "--engine", "hf", "--log_dir", str(log_dir), "--run_name", "src"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return log_dir / "src"


def replay(source: Path, name: str, *flags: str) -> Path:
    proc = subprocess.run([sys.executable, "-m", "distrl", "replay", str(source), "--log_dir",
                           str(source.parent), "--run_name", name, *flags],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[-400:])
    return source.parent / name


def expected_staleness(source: Path, max_staleness: int, replay_ratio: int, restamp: bool) -> list[list[int]]:
    """Per version, the staleness of every selected completion, by the buffer's rules alone."""
    store = GroupStore(batch_size=4, max_staleness=max_staleness, topk=4, group_size=4, replay_ratio=replay_ratio,
                       restamp=restamp)
    restore_store(store, source, use_consumed=False)
    out = []
    while store.select(len(out), 0, 1) is not None:
        out.append(list(store.last_staleness))
    return out


def events(run_dir: Path, role: str) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb" / role), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def check_tensorboard(run_dir: Path, expected: list[list[int]]) -> None:
    """learner0 (stepped by version + 1) and buffer0 (stepped by the selection's version) show ``expected``."""
    learner = events(run_dir, "learner0")
    assert {e.step: e.value for e in learner.Scalars("learner/staleness_max")} == {
        v + 1: max(s) for v, s in enumerate(expected)}
    assert {e.step: round(e.value, 6) for e in learner.Scalars("learner/staleness_mean")} == {
        v + 1: round(sum(s) / len(s), 6) for v, s in enumerate(expected)}
    assert [(h.step, h.histogram_value.max) for h in learner.Histograms("learner/staleness")] == [
        (v + 1, max(s)) for v, s in enumerate(expected)]
    buffer = events(run_dir, "buffer0")
    assert [(h.step, h.histogram_value.num, h.histogram_value.sum) for h in buffer.Histograms("buffer/staleness")] == [
        (v, len(s), sum(s)) for v, s in enumerate(expected)]


def test_replay_recorded_staleness_follows_the_source_timeline(source_run):
    out = replay(source_run, "recorded")
    expected = expected_staleness(source_run, max_staleness=1, replay_ratio=1, restamp=False)
    assert len(expected) >= 4 and any(max(s) > 0 for s in expected)  # the async source run had stale data
    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == len(expected)
    assert summary["staleness_max_by_version"] == [max(s) for s in expected]
    check_tensorboard(out, expected)
    # The replay's own consumption log, joined with the source's rows: the same staleness per completion.
    records = read_consumed(out)
    assert [r["learner_version"] for r in records] == list(range(len(expected)))
    assert [[r["learner_version"] - pv for pv in r["policy_versions"]] for r in records] == expected
    rows = lineage(source_run).to_pandas()
    assert rows["policy_version"].max() <= 4 and set(rows["actor_id"]) == {0}


def test_replay_restamp_with_replay_ratio_two_reuses_every_group(source_run):
    out = replay(source_run, "restamp", "--staleness_model", "restamp", "--replay_ratio", "2", "--max_staleness", "3")
    expected = expected_staleness(source_run, max_staleness=3, replay_ratio=2, restamp=True)
    groups = json.loads((out / "replay.json").read_text())["log_groups"]
    assert len(expected) > groups // 4  # more versions than the log has batches: groups were reused
    assert {x for s in expected for x in s} >= {0, 3} and max(max(s) for s in expected) <= 3
    check_tensorboard(out, expected)



def test_sweep_writes_table_and_plot_and_each_value_is_its_plain_replay(source_run):
    """`--sweep max_staleness=0,1` replays the log once per value into `<run>/max_staleness-<v>/` and writes
    sweep.md, .csv, .json and .png; value 0's numbers (held-out accuracy and mean length by version, staleness,
    the logged reward, the trained weights byte for byte) are those of a plain `distrl replay --max_staleness 0`."""
    sweep = replay(source_run, "sweep", "--sweep", "max_staleness=0,1", "--eval_size", "8")
    assert {"sweep.md", "sweep.csv", "sweep.json", "sweep.png", "max_staleness-0", "max_staleness-1"} <= {
        p.name for p in sweep.iterdir()}
    assert (sweep / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((sweep / "sweep.json").read_text())
    assert (result["flag"], result["values"], result["eval_size"]) == ("max_staleness", ["0", "1"], 8)
    plain = replay(source_run, "plain0", "--max_staleness", "0", "--eval_size", "8")
    swept, alone = (json.loads((d / "summary.json").read_text()) for d in (sweep / "max_staleness-0", plain))
    keys = ("versions", "heldout_accuracy_by_version", "staleness_max_by_version", "staleness_mean_by_version",
            "reward_by_version", "first_logprob_gap")
    assert {k: swept[k] for k in keys} == {k: alone[k] for k in keys}
    accuracy = alone["heldout_accuracy_by_version"]
    assert len(accuracy) == alone["versions"] + 1 and alone["staleness_max_by_version"] == [0] * alone["versions"]
    assert result["runs"]["0"]["heldout_accuracy_by_version"] == accuracy
    assert max(result["runs"]["1"]["staleness_max_by_version"]) == 1  # each value replayed with its own bound
    assert evaluations(sweep / "max_staleness-0") == evaluations(plain)  # mean_length too (half_vocab: accuracy 0)
    last = f"v{alone['versions']:06d}"
    assert weight_files(sweep / "max_staleness-0" / "weights" / last) == weight_files(plain / "weights" / last)
    # the table: a row per version, a column per value; value 0's column is the plain replay's accuracy
    csv = [line.split(",") for line in (sweep / "sweep.csv").read_text().splitlines()]
    assert csv[0] == ["version", "max_staleness=0", "max_staleness=1"]
    assert [float(row[1]) for row in csv[1:len(accuracy) + 1]] == [round(a, 4) for a in accuracy]
    assert "| version | max_staleness=0 | max_staleness=1 |" in (sweep / "sweep.md").read_text()


def weight_files(version_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(version_dir)): p.read_bytes() for p in sorted(version_dir.rglob("*")) if p.is_file()}


def evaluations(run_dir: Path) -> list[dict]:
    """eval.jsonl's metrics by version, without its timings."""
    lines = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in ("wall_s", "eval_s")} for line in lines]
