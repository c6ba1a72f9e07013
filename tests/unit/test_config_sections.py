"""The config per role (issue 17): sections owned by the roles, composed per command in distrl/cmd/config.py.

Each option is declared in one section; a command's config is the sections its role reads; building one
resolves derived values once, and validating it changes nothing.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from distrl.cmd.compose import flat_fields
from distrl.cmd.config import (
    BufferConfig,
    EvalConfig,
    LearnConfig,
    ReplayConfig,
    RolloutConfig,
    TrainConfig,
    kept_per_group,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MODULES = ["distrl/cmd/config.py", "distrl/cmd/config_offline.py", "distrl/core/run_options.py",
                  "distrl/rollout/config.py", "distrl/learn/config.py", "distrl/buffer/config.py",
                  "distrl/cmd/sections.py", "distrl/cmd/compose.py"]
COMMANDS = [TrainConfig, LearnConfig, RolloutConfig, BufferConfig, ReplayConfig, EvalConfig]


def sections(cls: type) -> dict[str, type]:
    """The named sections a command's config is made of (its fields whose type is a dataclass)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


@pytest.mark.parametrize("cls", COMMANDS)
def test_configs_are_composed_not_inherited(cls):
    """Issue 42: a command's config has no base class but object; its options live in named sections."""
    assert cls.__bases__ == (object,)
    assert all(section.__bases__ == (object,) for section in sections(cls).values())


@pytest.mark.parametrize("cls", [TrainConfig, LearnConfig, RolloutConfig, BufferConfig])
def test_each_option_is_declared_in_one_section(cls):
    seen: dict[str, str] = {}
    for name, section in sections(cls).items():
        for f in dataclasses.fields(section):
            assert f.name not in seen, f"{cls.__name__}: --{f.name} declared in {seen[f.name]} and {name}"
            seen[f.name] = name
    plain = {f.name for f in dataclasses.fields(cls)} - set(sections(cls))
    assert set(seen) | plain == {f.name for f in flat_fields(cls)}


def test_train_takes_every_section_of_the_roles():
    train = set(sections(TrainConfig).values())
    for cls in (LearnConfig, RolloutConfig):
        assert {s for s in sections(cls).values() if s.__module__ != "distrl.cmd.config"} <= train
    assert set(sections(BufferConfig).values()) - {sections(BufferConfig)["endpoint"]} <= train


def test_flat_keys_map_to_their_sections_and_back(tmp_path):
    cfg = TrainConfig(max_steps=3, topk_by="abs_advantage", seed=5, run_name="r", log_dir=str(tmp_path))
    assert (cfg.learn.max_steps, cfg.selection.topk_by, cfg.shared.seed, cfg.max_steps) == (3, "abs_advantage", 5, 3)
    flat = cfg.to_flat()
    assert flat["max_steps"] == 3 and "learn" not in flat and len(flat) == len(flat_fields(TrainConfig))
    assert TrainConfig.from_flat(flat) == cfg == TrainConfig.from_json(cfg.to_json())
    with pytest.raises(TypeError, match="unknown option.*no_such_flag"):
        TrainConfig.from_flat({**flat, "no_such_flag": 1})
    cfg.max_steps = 7  # a flat name sets its section's field
    assert cfg.learn.max_steps == 7 and not hasattr(cfg, "no_such_flag")


def test_validation_changes_nothing_and_derived_values_are_resolved_once(tmp_path):
    template = tmp_path / "prompt.txt"
    template.write_text("Q: {question}\nA:")
    configs = [TrainConfig(gpu_split="3:1", batch_size=6, prompt_template=str(template),
                           lora_target_modules=["q_proj"]),
               LearnConfig(number_of_learners=2, batch_size=8), RolloutConfig(actor_id=3, engine="hf"),
               BufferConfig(resume=str(tmp_path), topk=2)]
    for cfg in configs:
        before = cfg.to_flat()
        cfg.validate()
        assert cfg.to_flat() == before
        assert dataclasses.replace(cfg) == cfg  # building again from the resolved values resolves nothing new
    train, learn, rollout, buffer = configs
    assert (train.number_of_actors, train.number_of_learners, train.gpus_per_actor) == (3, 1, 1.0)
    assert train.run_name.startswith("distrl-") and train.prompt_template == str(template.resolve())
    assert train.lora_target_modules == ("q_proj",)
    assert (learn.number_of_actors, rollout.number_of_actors) == (1, 1)  # unset counts: 1
    assert buffer.run_dir == str(tmp_path) and kept_per_group(buffer.keep, buffer.batch) == 2


def test_cross_section_rules_hold_where_both_sections_are():
    with pytest.raises(ValueError, match="multiple of --number_of_learners"):
        LearnConfig(number_of_learners=3, batch_size=4)
    with pytest.raises(ValueError, match=r"--topk must be in \[1, --group_size=4\]"):
        TrainConfig(topk=5)
    with pytest.raises(ValueError, match="needs --finetune full"):
        LearnConfig(weights_transport="nccl")
    with pytest.raises(ValueError, match="--number_of_actors must be >= 1"):
        RolloutConfig(number_of_actors=0)
    assert LearnConfig(number_of_actors=0, learner_generates=True).number_of_actors == 0


def test_no_config_module_over_400_lines():
    sizes = {name: len((ROOT / name).read_text().splitlines()) for name in CONFIG_MODULES}
    assert max(sizes.values()) <= 400, sizes


GROUP_OF_ONE = "--group_size 1 with --learner {}: a group's advantages are its rewards minus the group's mean"


@pytest.mark.parametrize("command,flags,named", [
    ("train", [], "grpo"),
    ("train", ["--learner", "dr_grpo"], "dr_grpo"),
    ("learn", ["--learner", "pg"], "pg --pg_baseline group"),
])
def test_group_of_one_with_group_relative_advantages_is_refused_by_the_cli(tmp_path, command, flags, named):
    """Issue 40: every advantage is 0 with one completion a group; the run trained nothing and exited 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "distrl", command, "--group_size", "1", *flags,
                           "--log_dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    message = " ".join(line.strip(" │") for line in done.stderr.splitlines())  # tyro's box, unwrapped
    assert done.returncode == 2, done.stderr
    assert " ".join(GROUP_OF_ONE.format(named).split()) in " ".join(message.split())
    assert "use --group_size 2 or more" in message and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs", [dict(learner="pg", pg_baseline="running_mean"), dict(kl_coef=0.01),
                                    dict(learner="dr_grpo", kl_coef=0.1), dict(group_size=2)])
def test_group_of_one_is_allowed_with_a_baseline_that_is_not_the_group(kwargs):
    kwargs = {"group_size": 1, **kwargs}
    for cls in (TrainConfig, LearnConfig):
        assert cls(**kwargs).group_size == kwargs["group_size"]
    assert RolloutConfig(group_size=1).group_size == 1  # an actor alone has no loss to judge


def test_an_ipv6_host_is_refused_by_name(tmp_path):
    """The buffer and weight endpoints bind to tcp://HOST:PORT over IPv4: an IPv6 --host exits 2 naming the flag,
    before anything starts (it used to fail deep in the run's start-up)."""
    import subprocess
    import sys

    with pytest.raises(ValueError, match="--host must be an IPv4 address or a host name"):
        TrainConfig(host="::1")
    done = subprocess.run([sys.executable, "-m", "distrl", "train", "--host", "::1", "--log_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    message = " ".join(" ".join(line.strip(" │") for line in done.stderr.splitlines()).split())
    assert done.returncode == 2, done.stderr
    assert "--host must be an IPv4 address or a host name (IPv6 is not supported), got '::1'" in message
    assert list(tmp_path.iterdir()) == []
