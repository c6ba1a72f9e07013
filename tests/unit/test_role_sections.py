"""Each role reads only its own config sections and the foundation's (issue 42, config by composition).

Three checks, on the real code:

1. The source of each role package (`distrl/rollout`, `distrl/learn`, `distrl/buffer`), read with `ast`: no
   attribute read names an option that only another role's section (or a command's own section) declares, and no
   module imports another role's config module or a command's.
2. No flat config in a role package: a `cfg` (or `config`, `self.cfg`) read there is one section, so the options
   read from it all belong to one section (a composed config read flat, `cfg.seed` beside `cfg.group_size`, is
   found); the roles' entry points (Learner, RolloutActor, LearnerGenerator, Rollouts, load_task, the buffer's
   build_buffer, make_store and the in-process open_buffer) take no `cfg` argument.
3. A learner, a rollout actor and the buffer are built, in a fresh interpreter, from section objects made
   directly (no command config) and the parts assembled for them (a weight publisher, the buffer's address), and
   so are the in-process buffer and a --learner_generates generator (its Rollouts step run once on it): the
   process never imports `distrl.cmd`, so no composed config is in reach.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distrl.buffer.config import BufferEndpoint, SelectionOptions, StorageOptions, TopkOptions
from distrl.cmd.config import LearnEndpoints, RolloutEndpoints
from distrl.cmd.sections import ConfigFile, RunOptions, TrainOptions
from distrl.core.run_options import BatchOptions, SharedOptions, StalenessOptions
from distrl.learn.config import LearnOptions, WarmStartOptions
from distrl.rollout.config import PromptOptions, RolloutOptions, TaskOptions

ROOT = Path(__file__).resolve().parents[2]
FOUNDATION = (SharedOptions, BatchOptions, StalenessOptions)
OWN = {"rollout": (PromptOptions, TaskOptions, RolloutOptions),
       "learn": (LearnOptions, WarmStartOptions),
       "buffer": (TopkOptions, SelectionOptions, StorageOptions, BufferEndpoint)}
COMMANDS_OWN = (ConfigFile, RunOptions, TrainOptions, LearnEndpoints, RolloutEndpoints)
# option names that are also other attributes: Python's and transformers' (`str.join`, `Thread.join`,
# `model.config`, a parsed URL's `host`), and values a role is handed as arguments or parts, not read from a
# section (its `actor_id`, the `run_dir` it writes to, `ActorEndpoints.weights_pub`)
HOMONYMS = {"join", "config", "host", "actor_id", "run_dir", "weights_pub"}


def fields(*sections: type) -> set[str]:
    return {f.name for section in sections for f in dataclasses.fields(section)}


def foreign_options(role: str) -> set[str]:
    """Options declared only in sections that ``role`` does not receive (other roles', the commands')."""
    others = [s for name, own in OWN.items() if name != role for s in own] + list(COMMANDS_OWN)
    return fields(*others) - fields(*OWN[role], *FOUNDATION) - HOMONYMS


def attribute_reads(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every attribute read (``x.name``) in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)]


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("role", sorted(OWN))
def test_a_role_reads_no_option_of_another_roles_section(role):
    foreign = foreign_options(role)
    assert foreign, "the check would be empty"
    found = [f"{path.relative_to(ROOT)}:{line}: .{name}"
             for path in sorted((ROOT / "distrl" / role).rglob("*.py"))
             for line, name in attribute_reads(path) if name in foreign]
    assert found == [], f"distrl/{role} reads options of sections it does not receive:\n" + "\n".join(found)


@pytest.mark.parametrize("role", sorted(OWN))
def test_a_role_imports_no_other_roles_config_nor_a_commands(role):
    others = {f"distrl.{name}.config" for name in OWN if name != role}
    found = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "distrl" / role).rglob("*.py"))
             for name in imported(path) if name in others or name == "distrl.cmd" or name.startswith("distrl.cmd.")]
    assert found == []


def test_the_check_sees_a_foreign_read(tmp_path):
    """The scan finds what it looks for: a rollout module reading the learner's --max_steps."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(cfg):\n    return cfg.learn.max_steps\n")
    assert [name for _, name in attribute_reads(bad) if name in foreign_options("rollout")] == ["max_steps"]


SECTIONS = [s for own in OWN.values() for s in own] + list(FOUNDATION) + list(COMMANDS_OWN)
CONFIG_NAMES = {"cfg", "config", "self.cfg", "self.config"}


def option_owners() -> dict[str, set[str]]:
    """Option name (a section's field or property) -> the names of the sections that declare it."""
    owners: dict[str, set[str]] = {}
    for section in SECTIONS:
        names = [f.name for f in dataclasses.fields(section)]
        names += [name for name, value in vars(section).items() if isinstance(value, property)]
        for name in names:
            owners.setdefault(name, set()).add(section.__name__)
    return owners


def flat_config_reads(path: Path) -> list[str]:
    """Per function of ``path``: a config name (CONFIG_NAMES) whose option reads no single section declares all of."""
    owners, found = option_owners(), []
    functions = [n for n in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for function in functions:
        reads: dict[str, dict[str, int]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in owners:
                name = ast.unparse(node.value)
                if name in CONFIG_NAMES:
                    reads.setdefault(name, {}).setdefault(node.attr, node.lineno)
        for name, options in reads.items():
            if not set.intersection(*(owners[option] for option in options)):
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}: "
                             f"{function.name}: {name}." + ", .".join(f"{o} (line {n})" for o, n in options.items()))
    return found


@pytest.mark.parametrize("role", sorted(OWN))
def test_a_role_reads_no_flat_config(role):
    found = [hit for path in sorted((ROOT / "distrl" / role).rglob("*.py")) for hit in flat_config_reads(path)]
    assert found == [], f"distrl/{role} reads options of several sections from one config:\n" + "\n".join(found)


def test_the_check_sees_a_flat_config(tmp_path):
    """The scan finds a composed config read flat: a seed (shared) and a group size (batch) from one ``cfg``."""
    bad = tmp_path / "bad.py"
    bad.write_text("class R:\n    def step(self):\n        return self.cfg.seed * self.cfg.group_size\n"
                   "def load(cfg):\n    return cfg.task, cfg.reward\n"
                   "def fine(cfg):\n    return cfg.seed, cfg.max_new_tokens\n")
    assert sorted(hit.split(": ")[1] for hit in flat_config_reads(bad)) == ["load", "step"]


def test_the_roles_entry_points_take_sections_not_a_config():
    import inspect

    from distrl.buffer.assemble import build_buffer, make_store
    from distrl.buffer.inprocess import open_buffer
    from distrl.learn.learner import Learner
    from distrl.rollout.actor import RolloutActor
    from distrl.rollout.learner_generates import LearnerGenerator
    from distrl.rollout.rollouts import Rollouts, load_task

    names = {f.__qualname__: list(inspect.signature(f).parameters)
             for f in (Learner, RolloutActor, LearnerGenerator, Rollouts, load_task, build_buffer, make_store,
                       open_buffer)}
    assert {name: params for name, params in names.items() if {"cfg", "config"} & set(params)} == {}
    assert names["load_task"][:3] == ["prompt", "generation", "shared"]
    assert names["Rollouts"][:3] == ["generation", "shared", "batch"] and "log_samples" in names["Rollouts"]
    assert names["LearnerGenerator"][:4] == ["prompt", "generation", "shared", "batch"]
    assert names["open_buffer"][:5] == names["build_buffer"][:5] == ["batch", "staleness", "keep", "selection",
                                                                      "storage"]


BUILD_FROM_SECTIONS = textwrap.dedent("""
    import sys
    from pathlib import Path

    from distrl.buffer.assemble import build_buffer
    from distrl.buffer.config import BufferEndpoint, SelectionOptions, StorageOptions, TopkOptions
    from distrl.core.run_options import BatchOptions, SharedOptions, StalenessOptions
    from distrl.core.tiny import build_tiny_model
    from distrl.learn.config import LearnOptions
    from distrl.learn.learner import Learner
    from distrl.rollout.actor import ActorEndpoints, RolloutActor
    from distrl.rollout.config import PromptOptions, RolloutOptions, TaskOptions
    from distrl.weights import PublishOptions, transport

    work = Path(sys.argv[1])
    model = str(build_tiny_model(work / "model", seed=0))
    shared = SharedOptions(model=model, dtype="float32", max_new_tokens=8, number_of_actors=1,
                           weights_transport="fs", attest_weights=False)
    batch, staleness = BatchOptions(batch_size=2, group_size=2), StalenessOptions(max_staleness=1)
    server = build_buffer(batch, staleness, TopkOptions(), SelectionOptions(), StorageOptions(prefault_bytes=0),
                          work / "run", endpoint=BufferEndpoint(address="tcp://127.0.0.1:0", run_dir=str(work / "run")))
    publisher = transport("fs").publisher(PublishOptions(work / "run" / "weights"))
    learner = Learner(LearnOptions(max_steps=1, backend="hf"), shared, staleness, 0, 1, server.address, model,
                      publisher)
    endpoints = ActorEndpoints(server.address, *publisher.addresses)
    actor = RolloutActor(PromptOptions(task="arith"), TaskOptions(reward_workers=1), RolloutOptions(engine="hf"),
                         shared, batch, 0, endpoints, model, work_dir=str(work / "run"))
    assert learner.version == 0 and actor.version == 0 and server.store.stats()["groups"] == 0
    assert actor.rollouts.log_samples == 2  # RolloutOptions' default, handed to its Rollouts

    from distrl.buffer.inprocess import open_buffer
    from distrl.rollout.learner_generates import LearnerGenerator, generator_name

    inproc = open_buffer(batch, staleness, TopkOptions(), SelectionOptions(), StorageOptions(prefault_bytes=0),
                         work / "inproc")
    generator = LearnerGenerator(PromptOptions(task="arith"), TaskOptions(reward_workers=1), shared, batch, 0, 1,
                                 learner.model, inproc.client(generator_name(0)), model,
                                 policy_version=lambda: learner.version)
    assert generator.generate_once() and inproc.store.stats()["groups"] == batch.batch_size
    assert generator.summary()["groups"] == batch.batch_size and generator.rollouts.log_samples == 0
    for part in (generator, inproc, actor, learner, publisher, server):
        part.close()
    commands = sorted(name for name in sys.modules if name == "distrl.cmd" or name.startswith("distrl.cmd."))
    print("commands imported:", commands)
    sys.exit(1 if commands else 0)
""")


def test_each_role_builds_from_its_own_sections_alone(tmp_path):
    """Learner, actor and buffer (and the in-process buffer, a generator on the learner's model) from section
    objects and their assembled parts; no command config exists."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-c", BUILD_FROM_SECTIONS, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "commands imported: []" in done.stdout
