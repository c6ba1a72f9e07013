"""distrl.core.startup: marks written once per process and phase, read back as seconds from the launch and
the phases between them; a process that names no run marks nothing."""

from __future__ import annotations

import json

from distrl.core import startup


def test_marks_are_read_back_from_the_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(startup, "_target", None)
    startup.mark("launch", 1.0)  # no record_to yet: nothing written
    assert not (tmp_path / startup.FILE).exists()
    startup.record_to(tmp_path, "driver")
    startup.mark("launch", 100.0)
    startup.mark("train", 103.0)
    startup.mark("train", 190.0)  # a phase is marked the first time only
    startup.mark("ray_started", 110.5)
    startup.record_to(tmp_path, "learner0")
    for phase, t in (("role_started", 112.0), ("model_loaded", 120.0), ("ready", 150.0), ("first_batch", 151.0),
                     ("first_version", 152.5)):
        startup.mark(phase, t)
    startup.record_to(tmp_path, "learner0")  # a restarted process: its later marks do not replace the first
    startup.mark("model_loaded", 300.0)
    (tmp_path / startup.FILE).open("a").write("not json\n")
    out = startup.startup_summary(tmp_path)
    assert out["marks_s"]["driver"] == {"launch": 0.0, "train": 3.0, "ray_started": 10.5}
    assert out["marks_s"]["learner0"]["model_loaded"] == 20.0
    phases = out["phases_s"]
    assert phases["imports"] == 3.0 and phases["ray_start"] == 7.5 and phases["learner_model_load"] == 8.0
    assert phases["learner_warm_up"] == 30.0 and phases["first_step"] == 1.5
    assert phases["launch_to_first_version"] == 52.5
    assert "buffer" not in phases  # a mark missing: its phases are left out
    assert len((tmp_path / startup.FILE).read_text().splitlines()) == 10
    assert all(json.loads(line)["t"] > 0 for line in (tmp_path / startup.FILE).read_text().splitlines()[:-1])
    monkeypatch.setattr(startup, "_target", None)


def test_no_launch_mark_no_summary(tmp_path):
    assert startup.startup_summary(tmp_path) == {}


def test_process_start_is_before_now():
    import time

    assert 0 < startup.process_start() <= time.time()
