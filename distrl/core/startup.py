"""Start-up marks: when each process of a `distrl train` run reached each step between the launch and the
first policy version, so a run says where its start-up went (summary.json ``startup``).

A role process names its run and role once (:func:`record_to`, done by ``distrl.cmd.roles.begin_role``); then
:func:`mark` appends ``{"role", "phase", "t"}`` (wall clock) as one JSON line to ``<run_dir>/logs/startup.jsonl``
the first time this process reaches ``phase``: later calls are no-ops, so a loop may mark every pass. A process
that never called :func:`record_to` (the separate launchers, tests) marks nothing. :func:`startup_summary`
reads the file back: every mark in seconds from the launch, and the phases of :data:`PHASES` between them.
A mark made after torch compiled something carries the process's compile counters
(:func:`distrl.core.compile_cache.compile_counters`), so the summary also says what each role compiled or loaded
from the cache by each mark, and how many frames it compiled after its warm-up (``recompiles_after_warmup``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from distrl.core.compile_cache import compile_counters

FILE = "logs/startup.jsonl"

# name -> (from role, phase), (to role, phase): what summary.json's startup.phases_s reports
PHASES = {
    "imports": (("driver", "launch"), ("driver", "train")),  # interpreter, distrl and torch imports
    "ray_start": (("driver", "train"), ("driver", "ray_started")),  # run directory and ray.init
    "buffer": (("driver", "ray_started"), ("driver", "buffer_ready")),  # its Ray worker and bind (beside the roles')
    "learner_process": (("driver", "actors_created"), ("learner0", "role_started")),  # Ray worker up, imports
    "learner_model_load": (("learner0", "role_started"), ("learner0", "model_loaded")),
    "learner_warm_up": (("learner0", "model_loaded"), ("learner0", "ready")),  # compiles, optimizer, publisher
    "actor_process": (("driver", "actors_created"), ("actor0", "role_started")),
    "actor_engine_init": (("actor0", "role_started"), ("actor0", "engine_ready")),  # task, engine (vLLM: compile)
    # actor_engine_init in three: torch's and the rollout modules' imports and the task; transformers' import (or
    # nothing, for vLLM, which make_engine imports); the engine's build (model to the device, its sampler)
    "actor_imports_and_task": (("actor0", "role_started"), ("actor0", "task_loaded")),
    "actor_engine_imports": (("actor0", "task_loaded"), ("actor0", "engine_imported")),
    "actor_engine_build": (("actor0", "engine_imported"), ("actor0", "engine_ready")),
    "actor_engine_warm_up": (("actor0", "engine_ready"), ("actor0", "engine_warm")),
    "actor_waits_for_learner": (("actor0", "engine_warm"), ("actor0", "learner_endpoints")),
    "first_batch_wait": (("learner0", "ready"), ("learner0", "first_batch")),  # the actors' first groups
    "first_step": (("learner0", "first_batch"), ("learner0", "first_version")),  # its compiles, publish
    "launch_to_first_version": (("driver", "launch"), ("learner0", "first_version")),
}

_target: tuple[Path, str] | None = None  # (startup.jsonl, role) of this process
_marked: set[str] = set()


def record_to(run_dir: str | Path, role: str) -> None:
    """This process's marks go to ``<run_dir>/logs/startup.jsonl`` as ``role``."""
    global _target
    _target = (Path(run_dir) / FILE, role)
    _marked.clear()


def mark(phase: str, t: float | None = None) -> None:
    """Record that this process reached ``phase`` (at ``t``, default now), the first time only; a no-op in a
    process that never called :func:`record_to`. Never raises: a mark is worth less than the run."""
    if _target is None or phase in _marked:
        return
    _marked.add(phase)
    record = {"role": _target[1], "phase": phase, "t": time.time() if t is None else t}
    counters = compile_counters()
    if any(counters.values()):
        record["compile"] = counters
    line = json.dumps(record) + "\n"
    try:
        _target[0].parent.mkdir(parents=True, exist_ok=True)
        with open(_target[0], "a") as f:  # one short write per line: lines of several processes never mix
            f.write(line)
    except OSError:
        pass


def process_start() -> float:
    """This process's start (wall clock) from /proc; now where it cannot be read."""
    try:
        ticks = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def startup_summary(run_dir: str | Path) -> dict:
    """``marks_s``: role -> phase -> seconds from the driver's ``launch`` (each role's first mark of a phase: a
    restarted actor's marks are later); ``phases_s``: each :data:`PHASES` entry whose two marks exist. Empty
    without a launch mark."""
    path = Path(run_dir) / FILE
    marks: dict[str, dict[str, float]] = {}
    compiled: dict[str, dict[str, dict]] = {}
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            m = json.loads(line)
            marks.setdefault(m["role"], {}).setdefault(m["phase"], float(m["t"]))
            if isinstance(m.get("compile"), dict):
                compiled.setdefault(m["role"], {}).setdefault(m["phase"], m["compile"])
        except (ValueError, KeyError, TypeError):
            continue
    launch = marks.get("driver", {}).get("launch")
    if launch is None:
        return {}
    rel = {role: {phase: round(t - launch, 2) for phase, t in sorted(ms.items(), key=lambda kv: kv[1])}
           for role, ms in marks.items()}
    phases = {name: round(rel[b[0]][b[1]] - rel[a[0]][a[1]], 2) for name, (a, b) in PHASES.items()
              if a[1] in rel.get(a[0], {}) and b[1] in rel.get(b[0], {})}
    return {"phases_s": phases, "marks_s": rel, "compile": compiled,
            "recompiles_after_warmup": recompiles_after_warmup(compiled)}


# role kind -> the mark after which a role compiles nothing more (its warm-up is over)
WARM = {"learner": "first_version", "actor": "engine_warm"}


def recompiles_after_warmup(compiled: dict[str, dict[str, dict]]) -> int | None:
    """Dynamo frames compiled after each role's warm-up (:data:`WARM`) up to its ``finished`` mark, summed over
    the roles that have both marks; None when none has (a run that ended early, or compiled nothing)."""
    total, seen = 0, False
    for role, phases in compiled.items():
        warm = WARM.get(role.rstrip("0123456789"))
        if warm in phases and "finished" in phases:
            total += phases["finished"].get("frames_compiled", 0) - phases[warm].get("frames_compiled", 0)
            seen = True
    return total if seen else None
