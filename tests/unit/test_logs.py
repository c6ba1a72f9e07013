"""Where log lines go (distrl/core/logs.py) and how a role's error is shortened for the terminal
(distrl/cmd/faults.py)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

from distrl.cmd.faults import ROLE_ERROR_LINES, _short_error
from distrl.core.logs import ONCE, _Once, quiet_libraries, set_stderr_level, setup_logging

ROOT = Path(__file__).resolve().parents[2]

RAY_TRACEBACK = """\
ray::RolloutRole.run() (pid=12, ip=10.0.0.1, actor_id=ab12, repr=<distrl.cmd.roles.RolloutRole object>)
  File "/work/distrl/cmd/roles.py", line 131, in run
    return self.actor.run()
           ^^^^^^^^^^^^^^^^
  File "/work/rollout/actor.py", line 238, in _make_group
    scored = [self.reward(c.text, problem) for c in completions]
  File "/work/rollout/rewards.py", line 359, in __call__
    raise ValueError(reply["error"])
ValueError: --reward fails.py:score raised RuntimeError: reward failed on purpose
"""


def test_short_error_keeps_the_message_and_the_innermost_frames():
    lines = _short_error(RAY_TRACEBACK)
    assert lines == ["ValueError: --reward fails.py:score raised RuntimeError: reward failed on purpose",
                     '  File "/work/rollout/actor.py", line 238, in _make_group',
                     "    scored = [self.reward(c.text, problem) for c in completions]",
                     '  File "/work/rollout/rewards.py", line 359, in __call__',
                     '    raise ValueError(reply["error"])']


def test_short_error_cuts_a_long_message_and_reads_an_error_without_frames():
    long = RAY_TRACEBACK.replace("reward failed on purpose", "a\n" + "\n".join(f"detail {i}" for i in range(100)))
    lines = _short_error(long)
    assert lines[-1] == f"... ({100 - ROLE_ERROR_LINES} more lines in the log)"
    assert len(lines) == 5 + ROLE_ERROR_LINES + 1  # message, 2 frames (4 lines), the cut message, "... more"
    died = "The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutRole\n\tpid: 7\n"
    assert _short_error(died) == ["The actor died unexpectedly before finishing this task.",
                                  "\tclass_name: RolloutRole", "\tpid: 7"]


def test_quiet_libraries_drops_the_known_harmless_messages(caplog):
    quiet_libraries()
    with caplog.at_level(logging.INFO):
        logging.getLogger("torchao").warning("Failed to load _C_cutlass_90a.abi3.so")
        logging.getLogger("torchao.kernel.intmm").warning("Warning: Detected no triton")
        logging.getLogger("torch.utils._pytree").warning("<enum 'KernelPreference'> is an Enum subclass")
        logging.getLogger("distrl.actor").info("actor0: switched from policy version 0 to 1")
    assert [r.getMessage()[:30] for r in caplog.records] == ["actor0: switched from policy v"]
    # vLLM's per-generate warning: a once-filter on its logger (vLLM configures its own loggers, and earlier
    # tests in this process may have logged it, so the filter's behaviour is checked on a fresh logger below)
    for name, starts in ONCE.items():
        assert [f.starts for f in logging.getLogger(name).filters if isinstance(f, _Once)] == [starts]


def test_once_filter_passes_the_first_of_each_message_start(caplog):
    logger = logging.getLogger("distrl.tests.once")
    logger.addFilter(_Once(("CPU backend doesn't allow",)))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            logger.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding")
            logger.warning("another message")
    assert [r.getMessage()[:17] for r in caplog.records] == ["CPU backend doesn", "another message",
                                                             "another message", "another message"]


def test_a_role_writes_everything_to_its_log_file_and_nothing_to_the_terminal(tmp_path):
    log_file = tmp_path / "logs" / "actor0.log"
    script = textwrap.dedent(f"""
        import logging, os, sys, warnings
        from pathlib import Path
        from distrl.core.logs import role_logging
        role_logging(Path({str(log_file)!r}))
        logging.getLogger("distrl.actor").info("an INFO line")
        print("a library's print")
        warnings.warn("a library's warning")
        os.write(2, b"a C library's write to fd 2\\n")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr)
    text = log_file.read_text()
    for line in ("distrl.actor INFO an INFO line", "a library's print", "a library's warning", "a C library's write"):
        assert line in text, (line, text)


def test_stderr_level_hides_info_on_stderr_but_not_in_the_file(tmp_path, capsys):
    setup_logging(tmp_path / "driver.log")
    try:
        set_stderr_level(logging.WARNING)
        logging.getLogger("distrl.cmd.trainer").info("placement: ...")
        logging.getLogger("distrl.cmd.trainer").warning("a warning")
        err = capsys.readouterr().err
        assert "a warning" in err and "placement" not in err
        assert "placement: ..." in (tmp_path / "driver.log").read_text()
    finally:
        set_stderr_level(logging.NOTSET)
        logging.basicConfig(force=True, handlers=[logging.NullHandler()])
