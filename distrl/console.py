"""Live console view of `distrl train` on stderr (rich ``Live``), refreshed twice a second.

Shows the learner's policy version and the buffer's fill (from the buffer's STATS reply, polled over
the same ZMQ request socket every client uses: no new protocol), and the learner's mean reward,
staleness and tokens/s (from its TensorBoard events under ``<run_dir>/tb/learner0``, read
incrementally; they reach the disk within the learner's flush interval, about 10 s, so these lag the
version shown). The actors' log lines still go to stderr, above the view.

On only when stderr is a terminal and ``--console`` is left on (``--no_console`` turns it off);
otherwise :func:`start_console` returns None and nothing is drawn. The view is a convenience: an
error while polling is shown in the view, never raised into the run.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path


class LiveConsole:
    """A background thread that polls the run and redraws a small table on stderr.

    Args:
        buffer_address: the buffer's ZMQ address (STATS requests, sender ``console``).
        run_dir: the run directory (its ``tb/learner0`` events are read).
        max_steps: the run's ``--max_steps`` (shown as ``version v / max_steps``).
        max_rows: the buffer's ``--max_rows`` (fill = rows held / max_rows).
        interval_s: seconds between redraws.
    """

    def __init__(self, buffer_address: str, run_dir: str | Path, max_steps: int, max_rows: int,
                 interval_s: float = 0.5) -> None:
        self.buffer_address, self.run_dir = buffer_address, Path(run_dir)
        self.max_steps, self.max_rows, self.interval_s = max_steps, max_rows, interval_s
        self.start_time = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distrl-console", daemon=True)
        self._acc = None
        self._learner: dict[str, float] = {}

    def start(self) -> "LiveConsole":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and leave the last view on the screen (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _learner_scalars(self) -> dict[str, float]:
        """Newest value of each learner scalar (EventAccumulator reads only the new events each call)."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tb = self.run_dir / "tb" / "learner0"
        if self._acc is None and tb.is_dir():
            self._acc = EventAccumulator(str(tb), size_guidance={"scalars": 1})
        if self._acc is not None:
            self._acc.Reload()
            for tag in self._acc.Tags().get("scalars", []):
                self._learner[tag] = self._acc.Scalars(tag)[-1].value
        return self._learner

    def render(self, stats: dict | None, learner: dict[str, float], error: str | None = None):
        """The rich Table of one refresh (`stats`: the buffer's STATS reply, or None)."""
        from rich.table import Table

        table = Table(title=f"distrl train  {time.time() - self.start_time:6.1f} s", title_justify="left")
        for name in ("version", "reward", "staleness mean/max", "learner tok/s", "buffer rows", "groups put"):
            table.add_column(name, justify="right")

        def fmt(tag: str, spec: str) -> str:
            return format(learner[tag], spec) if tag in learner else "-"

        version = f"{stats['learner_version']}/{self.max_steps}" if stats else "-"
        rows = f"{stats['rows']} ({100 * stats['rows'] / self.max_rows:.2g}%)" if stats else "-"
        table.add_row(version, fmt("learner/reward_mean", ".3f"),
                      f"{fmt('learner/staleness_mean', '.2f')}/{fmt('learner/staleness_max', '.0f')}",
                      fmt("learner/tokens_per_s", ".0f"), rows, str(stats["groups_put"]) if stats else "-")
        if error:
            table.caption = error
        return table

    def _loop(self) -> None:
        from rich.console import Console
        from rich.live import Live

        from buffer.client import BufferClient

        client = BufferClient(self.buffer_address, "console", timeout_s=2.0, retries=0)
        last_tb = 0.0
        with Live(self.render(None, {}), console=Console(file=sys.stderr), refresh_per_second=4,
                  transient=False) as live:
            while not self._stop.is_set():
                stats, error = None, None
                try:
                    stats = client.stats()
                except Exception as exc:  # noqa: BLE001 - a view never ends the run
                    error = f"buffer STATS: {type(exc).__name__}: {exc}"
                if time.time() - last_tb > 2.0:
                    last_tb = time.time()
                    try:
                        self._learner_scalars()
                    except Exception as exc:  # noqa: BLE001
                        error = f"learner events: {type(exc).__name__}: {exc}"
                live.update(self.render(stats, self._learner, error))
                self._stop.wait(self.interval_s)
        client.close()


def start_console(enabled: bool, buffer_address: str, run_dir: str | Path, max_steps: int,
                  max_rows: int) -> LiveConsole | None:
    """A started :class:`LiveConsole` when `enabled` (``--console``) and stderr is a terminal, else None."""
    if not enabled or not sys.stderr.isatty():
        return None
    return LiveConsole(buffer_address, run_dir, max_steps, max_rows).start()
