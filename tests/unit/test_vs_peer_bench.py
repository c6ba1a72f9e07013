"""bench/vs_peer.py (issue 43): verl's console lines parsed, its window's completions/s, its launch clock with
checkpoint saves left out and its checkpoints evaluated by distrl's evaluation, the torch stub the dry-runs use,
and the override check against a config."""

import json
import zipfile
from argparse import Namespace

from bench.vs_peer import check_overrides, parse_step, torch_stub, verl_curve, verl_rate


def test_console_line_with_rays_prefix():
    step, m = parse_step("(TaskRunner pid=7) step:3 - actor/lr:2e-05 - timing_s/step:1.25 - response_length/mean:12.5")
    assert step == 3 and m == {"actor/lr": 2e-05, "timing_s/step": 1.25, "response_length/mean": 12.5}
    assert parse_step("Training Progress: 10%") is None


def test_window_rate_from_step_timings():
    args = Namespace(warmup=1, versions=2, batch_size=4, group_size=2)
    side = {"steps": [[s, 10.0 + s, {"timing_s/step": 2.0, "response_length/mean": 5.0}] for s in (1, 2, 3, 4)]}
    assert verl_rate(side, args) == {"steps_timed": 2, "wall_s": 4.0, "completions_per_s": 4.0,
                                     "mean_completion_tokens": 5.0}


def test_launch_clock_leaves_out_saves_and_checkpoints_are_evaluated(tmp_path):
    from distrl.core.tiny import build_tiny_model

    model = str(build_tiny_model(tmp_path / "tiny", seed=0))
    ckpt = tmp_path / "ckpt" / "global_step_2" / "actor"
    ckpt.mkdir(parents=True)
    (ckpt / "huggingface").symlink_to(model)  # a "saved" actor: the same weights
    side = {"ckpt": str(tmp_path / "ckpt"),
            "steps": [[1, 20.0, {"timing_s/step": 3.0}],
                      [2, 25.0, {"timing_s/step": 2.0, "timing_s/save_checkpoint": 1.5}],
                      [3, 27.0, {"timing_s/step": 2.0}]]}
    args = Namespace(model_dir=model, eval_size=4, eval_every=2, max_new_tokens=4)
    out = verl_curve(side, args)
    assert out["startup_s"] == 17.0 and out["first_version_s"] == 20.0  # step 1 began 3 s before its line
    assert [(t, s) for t, s, _ in out["launch_curve"]] == [(17.0, 0), (23.5, 2)]  # step 2 less its 1.5 s save
    assert out["launch_curve"][0][2] == out["launch_curve"][1][2]  # the same weights: the same accuracy


def test_torch_stub_is_a_wheel_named_as_the_images_torch(tmp_path):
    path = torch_stub(tmp_path)
    assert path.name == "torch-2.11.0+cu130-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        meta = zf.read("torch-2.11.0+cu130.dist-info/METADATA").decode()
    assert "Version: 2.11.0+cu130" in meta and "Requires-Dist" not in meta


def test_unknown_override_keys(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"trainer": {"save_freq": -1}, "data": {"seed": None}}))
    assert check_overrides(["trainer.save_freq=5", "data.seed=1", "trainer.bogus=1"], config) == ["trainer.bogus=1"]


def test_run_and_report_on_fake_sides(tmp_path, monkeypatch):
    import bench.vs_peer as vp

    monkeypatch.setattr("distrl.core.gguf.resolve_model", lambda m: m)
    monkeypatch.setattr(vp, "distrl_arith", lambda args, out: {"launch_curve": [(20.0, 0, 0.1), (30.0, 25, 0.21)]})
    monkeypatch.setattr(vp, "run_verl", lambda args, model, work, out: {"steps": [], "ckpt": ""})
    monkeypatch.setattr(vp, "verl_curve", lambda side, args: {"launch_curve": [(40.0, 0, 0.1), (90.0, 30, 0.2)]})
    monkeypatch.setattr(vp, "distrl_variable", lambda args, out: {"completions_per_s": 200.0})
    monkeypatch.setattr(vp, "verl_rate", lambda side, args: {"completions_per_s": 50.0})
    base = dict(model="m", dataset="d", work=str(tmp_path / "w"), out=str(tmp_path / "o"))
    arith = vp.run(Namespace(workload="arith", **base))
    assert arith["target_accuracy"] == 0.2 and arith["vs_peer_time_to_accuracy_from_launch"] == 3.0
    assert vp.run(Namespace(workload="variable", **base))["vs_peer_variable"] == 4.0
    results = tmp_path / "vs_peer.json"
    results.write_text(json.dumps({"peer_install_conflicts": {"areal": {}}}))
    out = vp.report([str(tmp_path / "o")], "test", results)
    assert out["peer"]["name"] == "verl" and out["peer_install_conflicts"] == {"areal": {}}
    assert (out["vs_peer_variable"], out["vs_peer_variable_runs"]) == (4.0, [4.0])
    assert out["vs_peer_time_to_accuracy_from_launch_runs"] == [3.0]
