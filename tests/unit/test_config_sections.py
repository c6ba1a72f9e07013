"""The config per role (issue 17): sections owned by the roles, composed per command in distrl/cmd/config.py.

Each option is declared in one section; a command's config is the sections its role reads; building one
resolves derived values once, and validating it changes nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from distrl.cmd.config import BufferConfig, LearnConfig, RolloutConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MODULES = ["distrl/cmd/config.py", "distrl/cmd/config_offline.py", "distrl/core/run_options.py",
                  "distrl/rollout/config.py", "distrl/learn/config.py", "distrl/buffer/config.py"]


def sections(cls: type) -> list[type]:
    """The dataclasses a command's config is made of (its bases that declare fields themselves)."""
    return [base for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) and own_fields(base)]


def own_fields(section: type) -> list[str]:
    return list(vars(section).get("__annotations__", {}))


@pytest.mark.parametrize("cls", [TrainConfig, LearnConfig, RolloutConfig, BufferConfig])
def test_each_option_is_declared_in_one_section(cls):
    seen: dict[str, str] = {}
    for section in sections(cls):
        for name in own_fields(section):
            assert name not in seen, f"{cls.__name__}: --{name} declared in {seen[name]} and {section.__name__}"
            seen[name] = section.__name__
    assert set(seen) == {f.name for f in dataclasses.fields(cls)}


def test_train_takes_every_section_of_the_roles():
    train = set(sections(TrainConfig))
    for cls in (LearnConfig, RolloutConfig):
        assert {s for s in sections(cls) if s.__module__ != "distrl.cmd.config"} <= train
    buffer_sections = {s.__name__ for s in sections(BufferConfig)} - {"BufferEndpoint", "_ConfigFile"}
    assert buffer_sections <= {s.__name__ for s in train}


def test_validation_changes_nothing_and_derived_values_are_resolved_once(tmp_path):
    template = tmp_path / "prompt.txt"
    template.write_text("Q: {question}\nA:")
    configs = [TrainConfig(gpu_split="3:1", batch_size=6, prompt_template=str(template),
                           lora_target_modules=["q_proj"]),
               LearnConfig(number_of_learners=2, batch_size=8), RolloutConfig(actor_id=3, engine="hf"),
               BufferConfig(resume=str(tmp_path), topk=2)]
    for cfg in configs:
        before = dataclasses.asdict(cfg)
        cfg.validate()
        assert dataclasses.asdict(cfg) == before
        assert dataclasses.replace(cfg) == cfg  # building again from the resolved values resolves nothing new
    train, learn, rollout, buffer = configs
    assert (train.number_of_actors, train.number_of_learners, train.gpus_per_actor) == (3, 1, 1.0)
    assert train.run_name.startswith("distrl-") and train.prompt_template == str(template.resolve())
    assert train.lora_target_modules == ("q_proj",)
    assert (learn.number_of_actors, rollout.number_of_actors) == (1, 1)  # unset counts: 1
    assert buffer.run_dir == str(tmp_path) and buffer.k == 2


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
