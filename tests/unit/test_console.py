"""The live console view (distrl/cmd/console.py): what one refresh shows, and when it is off."""

from __future__ import annotations

import io

from rich.console import Console

from distrl.cmd.console import LiveConsole, start_console
from distrl.core.metrics import Metrics


def text_of(table) -> str:
    out = io.StringIO()
    Console(file=out, width=140).print(table)
    return out.getvalue()


def test_render_shows_version_reward_staleness_and_fill(tmp_path):
    with Metrics(tmp_path / "tb" / "learner0") as m:
        m.scalars({"learner/reward_mean": 0.25, "learner/staleness_mean": 0.5, "learner/staleness_max": 1,
                   "learner/tokens_per_s": 1234.0}, step=3)
    view = LiveConsole("tcp://127.0.0.1:1", tmp_path, max_steps=10, max_rows=1000)
    learner = view._learner_scalars()  # the learner's events as written above
    text = text_of(view.render({"learner_version": 3, "rows": 50, "groups_put": 12}, learner))
    for expected in ("3/10", "0.250", "0.50/1", "1234", "50 (5%)", "12"):
        assert expected in text, (expected, text)
    assert "-" in text_of(view.render(None, {}, error="buffer STATS: TimeoutError"))


def test_progress_lines_without_a_terminal_or_with_no_console(tmp_path, capsys):
    # pytest captures stderr, so it is not a terminal here: plain progress lines either way
    for enabled in (True, False):
        view = start_console(enabled, "tcp://127.0.0.1:1", tmp_path, 10, 1000)
        view.stop()
        assert not view.live
    view = LiveConsole("tcp://127.0.0.1:1", tmp_path, max_steps=10, max_rows=1000, live=False, every_s=3600)
    view._progress({"learner_version": 3, "rows": 50, "groups_put": 12})  # every_s not passed: no line
    view._progress({"learner_version": 10, "rows": 50, "groups_put": 40})  # the last version: a line
    view._progress({"learner_version": 10, "rows": 50, "groups_put": 40})  # same version: none
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "version 10/10" in lines[0] and "groups put 40" in lines[0], lines


def test_finish_polls_once_more_while_the_buffer_answers(tmp_path, capsys):
    """`distrl train` calls finish() before the buffer shuts down: one last poll shows the run's end (here the
    only one: the interval is never reached), then polling stops; a later stop() is harmless."""
    from tests.unit.test_buffer_server import serving

    with serving(tmp_path, batch_size=2) as server:
        view = LiveConsole(server.address, tmp_path, max_steps=10, max_rows=1000, interval_s=3600, live=False,
                           every_s=0).start()
        view.finish()
        assert not view._thread.is_alive()
        view.stop()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distrl: ")]  # not log lines
    assert len(lines) == 1 and lines[0].startswith("distrl: version 0/10") and "groups put 0" in lines[0], lines
