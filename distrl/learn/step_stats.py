"""What a learner step reports: its metrics from the micro-batches' (:func:`combine`), and the per-version series
`Learner.run` returns (:class:`History`)."""

from __future__ import annotations

from array import array

import pyarrow as pa

from distrl.learn.batch import list_lengths


class History:
    """The per-version series `Learner.run` returns (``rows()``: one dict per version with the keys of
    ``TAGS``; every other metric is in TensorBoard only), held as typed arrays: 40 bytes a version, where a
    dict of every metric per version cost ~2 KB (gigabytes over a week-long run)."""

    TAGS = {"learner/loss": "d", "learner/reward_mean": "d", "learner/grad_norm": "d",
            "learner/staleness_mean": "d", "learner/staleness_max": "q"}  # tag -> array type code

    def __init__(self) -> None:
        self.series = {tag: array(code) for tag, code in self.TAGS.items()}

    def append(self, stats: dict) -> None:
        """Record one version's ``stats`` (must hold every tag of ``TAGS``; other keys are ignored)."""
        for tag, series in self.series.items():
            series.append(stats[tag])

    def rows(self) -> list[dict]:
        return [dict(zip(self.series, row)) for row in zip(*self.series.values())]

    @property
    def nbytes(self) -> int:
        return sum(s.itemsize * len(s) for s in self.series.values())


def combine(parts: list[dict], table: pa.Table, version: int, grad_norm: float) -> dict:
    """Token-weighted means of micro-batch metrics (maxima of ``*_max``, minima of ``*_min``), and
    batch-level statistics of this rank's shard. An empty ``parts`` (skipped step) gives no loss metrics."""
    n = sum(p["masked_tokens"] for p in parts)
    staleness = (version - table.column("policy_version").to_numpy()).tolist() or [0]
    p_len, c_len = list_lengths(table, "prompt_ids"), list_lengths(table, "completion_ids")
    stats = {
        "learner/grad_norm": grad_norm,
        "learner/staleness_mean": sum(staleness) / len(staleness),
        "learner/staleness_max": max(staleness),
        "learner/completion_tokens": float(c_len.sum()),
        "staleness_values": staleness,
        "tokens": int(p_len.sum() + c_len.sum()),
    }
    if not parts or n == 0:
        return stats
    stats["learner/entropy"] = sum(p["entropy_sum"] for p in parts) / n
    skip = {"masked_tokens", "loss", "entropy_sum"}
    for key in sorted({k for p in parts for k in p} - skip):
        values = [(p[key], p["masked_tokens"]) for p in parts if key in p]
        if key.endswith("_max"):
            stats[f"learner/{key}"] = max(v for v, _ in values)
        elif key.endswith("_min"):
            stats[f"learner/{key}"] = min(v for v, _ in values)
        else:
            stats[f"learner/{key}"] = sum(v * w for v, w in values) / n
    return stats
