"""What `distrl train` shows while it runs, on stderr: a live view (rich ``Live``) refreshed twice a
second on a terminal, progress lines otherwise.

Shows the learner's policy version and the buffer's fill (from the buffer's STATS reply, polled over
the same ZMQ request socket every client uses: no new protocol), and the learner's mean reward,
staleness and tokens/s (from its TensorBoard events under ``<run_dir>/tb/learner0``, read
incrementally; they reach the disk within the learner's flush interval, about 10 s, so these lag the
version shown). The roles log to ``<run_dir>/logs/<role>.log`` only (distrl.core.logs); while the view
stands, the driver's own log lines reach stderr from WARNING up (printed above the view). One of them comes
from here: the first time an actor's ``actor/reward_timeouts`` (``tb/actor<i>``) is above 0, a warning that
rewards ran past their time limit and scored 0.

The live view is on when stderr is a terminal and ``--console`` is left on. With ``--no_console`` or
when stderr is not a terminal (CI, pipes), the same poll prints one plain progress line when the
version advanced and ``every_s`` seconds passed since the last line (and at the last version). Either
is a convenience: an error while polling is shown in the view, never raised into the run.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("distrl.cmd.console")


class LiveConsole:
    """A background thread that polls the run and redraws a small table on stderr.

    Args:
        buffer_address: the buffer's ZMQ address (STATS requests, sender ``console``).
        run_dir: the run directory (its ``tb/learner0`` events are read).
        max_steps: the run's ``--max_steps`` (shown as ``version v / max_steps``).
        max_rows: the buffer's ``--max_rows`` (fill = rows held / max_rows).
        interval_s: seconds between redraws (polls).
        live: the rich live view (True) or plain progress lines (False).
        every_s: least seconds between two progress lines (plain lines only).
    """

    def __init__(self, buffer_address: str, run_dir: str | Path, max_steps: int, max_rows: int,
                 interval_s: float = 0.5, live: bool = True, every_s: float = 10.0) -> None:
        self.buffer_address, self.run_dir = buffer_address, Path(run_dir)
        self.max_steps, self.max_rows, self.interval_s = max_steps, max_rows, interval_s
        self.live, self.every_s = live, every_s
        self._printed: tuple[int, float] = (-1, time.time())  # (version, unix time) of the last progress line
        self._last_tb = 0.0
        self.start_time = time.time()
        self._stop = threading.Event()
        self._final_poll = False  # set by finish(): one last poll after the loop
        self._thread = threading.Thread(target=self._loop, name="distrl-console", daemon=True)
        self._acc = None
        self._learner: dict[str, float] = {}
        self._actor_accs: dict[Path, object] = {}  # tb/actor<i> -> its EventAccumulator
        self._warned_timeouts = False

    def start(self) -> "LiveConsole":
        if self.live:  # the view stands alone: the driver's INFO lines go to its log file only
            from distrl.core.logs import set_stderr_level

            set_stderr_level(logging.WARNING)
        self._thread.start()
        return self

    def finish(self) -> None:
        """The run is over and the buffer still answers: poll once more (the view, or the last progress
        line, shows the run's end), then stop polling; :meth:`stop` still restores stderr's level. Called
        before the buffer shuts down: a poll after that would wait out the client's 2 s timeout."""
        self._final_poll = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def stop(self) -> None:
        """Stop polling and leave the last view on the screen (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.live:
            from distrl.core.logs import set_stderr_level

            set_stderr_level(logging.NOTSET)

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

    def _warn_reward_timeouts(self) -> None:
        """Once: a warning when an actor's events show a reward that ran past its time limit (it scored 0)."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for tb in [] if self._warned_timeouts else sorted((self.run_dir / "tb").glob("actor*")):
            acc = self._actor_accs.setdefault(tb, EventAccumulator(str(tb), size_guidance={"scalars": 1}))
            acc.Reload()
            count = acc.Scalars("actor/reward_timeouts")[-1].value if "actor/reward_timeouts" in \
                acc.Tags().get("scalars", []) else 0
            if count > 0:
                log.warning("%s: %d rewards ran past their time limit (--reward_timeout_s, or math_verify's 5 s) "
                            "and scored 0; TensorBoard actor/reward_timeouts counts them (logs/%s.log)",
                            tb.name, count, tb.name)
                self._warned_timeouts = True
                return

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

    def line(self, stats: dict, learner: dict[str, float]) -> str:
        """One plain progress line (`stats`: the buffer's STATS reply)."""
        def fmt(tag: str, spec: str) -> str:
            return format(learner[tag], spec) if tag in learner else "-"

        return (f"distrl: version {stats['learner_version']}/{self.max_steps}"
                f"  reward {fmt('learner/reward_mean', '.3f')}"
                f"  staleness {fmt('learner/staleness_mean', '.2f')}/{fmt('learner/staleness_max', '.0f')}"
                f"  buffer rows {stats['rows']}  groups put {stats['groups_put']}"
                f"  [{time.time() - self.start_time:.0f} s]")

    def _progress(self, stats: dict | None) -> None:
        """Print a progress line if the version advanced and every_s passed (or it is the last version)."""
        version, at = self._printed
        if stats is None or stats["learner_version"] == version:
            return
        if time.time() - at >= self.every_s or stats["learner_version"] >= self.max_steps:
            print(self.line(stats, self._learner), file=sys.stderr, flush=True)
            self._printed = (stats["learner_version"], time.time())

    def _poll(self, client) -> tuple[dict | None, str | None]:
        """(the buffer's STATS or None, an error text or None); the learner's events re-read every 2 s."""
        stats, error = None, None
        try:
            stats = client.stats()
        except Exception as exc:  # noqa: BLE001 - a view never ends the run
            error = f"buffer STATS: {type(exc).__name__}: {exc}"
        if time.time() - self._last_tb > 2.0:
            self._last_tb = time.time()
            try:
                self._learner_scalars()
                self._warn_reward_timeouts()
            except Exception as exc:  # noqa: BLE001
                error = f"learner or actor events: {type(exc).__name__}: {exc}"
        return stats, error

    def _loop(self) -> None:
        from rich.console import Console
        from rich.live import Live

        from distrl.core.buffer_client import BufferClient

        client = BufferClient(self.buffer_address, "console", timeout_s=2.0, retries=0)
        try:
            if not self.live:
                while not self._stop.wait(self.interval_s):
                    self._progress(self._poll(client)[0])
                if self._final_poll:
                    self._progress(self._poll(client)[0])
                return
            with Live(self.render(None, {}), console=Console(file=sys.stderr), refresh_per_second=4,
                      transient=False) as live:
                while not self._stop.is_set():
                    stats, error = self._poll(client)
                    live.update(self.render(stats, self._learner, error))
                    self._stop.wait(self.interval_s)
                if self._final_poll:
                    stats, error = self._poll(client)
                    live.update(self.render(stats, self._learner, error))
        finally:
            client.close()


def start_console(enabled: bool, buffer_address: str, run_dir: str | Path, max_steps: int,
                  max_rows: int) -> LiveConsole:
    """A started :class:`LiveConsole`: the live view when `enabled` (``--console``) and stderr is a
    terminal, else plain progress lines."""
    live = enabled and sys.stderr.isatty()
    return LiveConsole(buffer_address, run_dir, max_steps, max_rows, live=live).start()
