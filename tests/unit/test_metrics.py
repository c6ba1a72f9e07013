"""distrl.core.metrics writes event files that TensorBoard's own reader reads back (and needs no torch)."""

import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distrl.core.metrics import Metrics


def reload(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_histogram_and_text_read_back(tmp_path):
    with Metrics(tmp_path) as m:
        m.scalar("loss", 0.5, step=0)
        m.scalars({"loss": 0.25, "reward": 1.5}, step=1)
        m.histogram("staleness", [0, 1, 1, 2, 2, 2], step=1)
        m.histogram("ratio", [0.9, 1.0, 1.1, 1.3], step=2)
        m.histogram("empty", [], step=2)
        m.text("config", "batch_size: 4", step=0)
    acc = reload(tmp_path)
    assert [(s.step, s.value) for s in acc.Scalars("loss")] == [(0, 0.5), (1, 0.25)]
    assert acc.Scalars("reward")[0].value == 1.5 and acc.Scalars("reward")[0].wall_time > 1e9
    (h,) = acc.Histograms("staleness")
    hv = h.histogram_value
    assert (h.step, hv.num, hv.min, hv.max, hv.sum, hv.sum_squares) == (1, 6, 0, 2, 8, 14)
    assert list(hv.bucket) == [1, 2, 3] and list(hv.bucket_limit) == [0.5, 1.5, 2.5]
    (r,) = acc.Histograms("ratio")
    assert r.histogram_value.num == 4 and sum(r.histogram_value.bucket) == 4
    assert "empty" not in acc.Tags()["histograms"]
    (t,) = acc.Tensors("config")
    assert t.tensor_proto.string_val == [b"batch_size: 4"]


def test_flush_makes_events_visible_before_close(tmp_path):
    m = Metrics(tmp_path, flush_secs=3600)
    m.scalar("x", 3, step=7)
    m.flush()
    assert reload(tmp_path).Scalars("x")[0].step == 7
    m.close()
    m.close()


def test_non_finite_histogram_refused(tmp_path):
    with Metrics(tmp_path) as m, pytest.raises(ValueError, match="non-finite"):
        m.histogram("h", [1.0, float("nan")], step=0)


def test_none_logdir_is_a_no_op(tmp_path):
    m = Metrics(None)
    m.scalar("x", 1, 0)
    m.scalars({"y": 2}, 0)
    m.histogram("h", [1, 2], 0)
    m.text("t", "hi", 0)
    m.flush()
    m.close()


def test_metrics_do_not_import_torch(tmp_path):
    code = ("import sys, distrl.core.metrics as dm; m = dm.Metrics(sys.argv[1]); m.scalar('a', 1, 0); m.close(); "
            "assert 'torch' not in sys.modules")
    root = Path(__file__).parents[2]
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=root)
