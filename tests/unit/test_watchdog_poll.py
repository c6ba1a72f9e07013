"""The driver's watchdog never blocks its loop for long: one STATS waits distrl.cmd.faults.STATS_POLL_S at most, and
a silent buffer is named only once it has been silent for --heartbeat_timeout_s over several checks. (A STATS
that waited the whole --heartbeat_timeout_s kept `distrl train` from seeing Ray's error for a killed buffer, or its
lost node, for 300 s: found by bench/chaos.py.)"""

from __future__ import annotations

import time

import zmq

from distrl.cmd import faults
from distrl.cmd.faults import Watchdog


def test_a_silent_buffer_is_named_after_the_timeout_each_check_short(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "STATS_POLL_S", 0.2)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # a buffer that takes requests and never answers (hung, or its node gone)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    dog = Watchdog(f"tcp://127.0.0.1:{port}", tmp_path, timeout_s=1.0)
    try:
        start, verdicts = time.monotonic(), []
        while not verdicts and time.monotonic() - start < 10:
            began = time.monotonic()
            verdicts = dog.check([])
            assert time.monotonic() - began < 0.6  # one check: about STATS_POLL_S, never the whole timeout
        waited = time.monotonic() - start
        assert 0.7 <= waited < 3.0, waited
        assert [name for name, _ in verdicts] == ["buffer0"]
        assert "no answer to STATS for 1 s (--heartbeat_timeout_s 1)" in verdicts[0][1], verdicts
    finally:
        dog.close()
        silent.close()
        ctx.term()
