"""The log-reading snippet of docs/buffer.md runs as written, on a real segment log."""

import re
from pathlib import Path

from distrl.buffer.segments import ConsumptionLog, SegmentLog
from tests.helpers import make_group

DOC = Path(__file__).resolve().parents[2] / "docs" / "buffer.md"


def test_reading_the_log_snippet_runs(tmp_path, capsys):
    log = SegmentLog(tmp_path, group_size=4)
    log.append(make_group("a", policy_version=0, actor_id=1), 0)
    log.append(make_group("b", policy_version=1, actor_id=2), 1)
    log.close()
    consumed = ConsumptionLog(tmp_path)
    consumed.append(2, 0, make_group("b", policy_version=1, actor_id=2))
    consumed.close()
    section = DOC.read_text().split("## Reading the log")[1]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, re.S)
    exec(snippet, {"run_dir": str(tmp_path)})  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "8 completions, mean reward 1.5" in out
    assert "1    4" in out  # staleness 1 for the 4 completions of b, trained at version 2
