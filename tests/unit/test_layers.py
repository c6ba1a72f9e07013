"""The layers of issue 17, enforced on the import graph (``tests/layers.py`` builds it and checks it).

    foundation  distrl.core.* (the buffer's client and CURVE keys included), distrl.weights.*
        ^
    roles       distrl.rollout.*, distrl.learn.*, distrl.buffer.*   (each: the foundation and itself; buffer: no torch)
        ^
    commands    distrl.cmd.*, distrl.__main__   (anything)

plus: no import cycle, function-local imports included. ALLOWED lists today's violations, each with the
issue item that removes it; the test fails on a new violation and on an entry that no longer breaks a
rule, so the list only shrinks (docs/design.md, "Layers").
"""

from __future__ import annotations

from pathlib import Path

from tests.layers import check, import_graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["distrl"]

# module (or ``package.*``: it and every module under it) -> layer; a module's own entry wins over a ``.*``.
LAYERS = {
    # foundation: what every role shares -- the wire, weights by version, metrics, logging, errors, models
    "distrl": "foundation",  # the package (empty __init__)
    "distrl.core.*": "foundation",  # wire, buffer_client, security, errors, logs, metrics, advantages, ...
    "distrl.weights.*": "foundation",  # weights by policy version: announce, publish, fetch (fs, zmq, nccl)
    # roles
    "distrl.rollout.*": "rollout",
    "distrl.learn.*": "learn",
    "distrl.buffer.*": "buffer",
    # commands: parse flags, compose the config, assemble and launch roles, report
    "distrl.cmd.*": "command",  # cli, config, trainer, launch, replay, evaluate, console, faults, placement, ...
    "distrl.__main__": "command",  # `python -m distrl`
}
MAY_IMPORT = {
    "foundation": {"foundation"},
    "rollout": {"foundation", "rollout"},
    "learn": {"foundation", "learn"},
    "buffer": {"foundation", "buffer"},
    "command": {"foundation", "rollout", "learn", "buffer", "command"},
}
FORBIDDEN_EXTERNAL = {"buffer": {"torch"}}

# Today's violations: (module, imported) -> the issue item that removes it. Only ever remove entries.
ALLOWED = {
    # issue 17, layers: role logic out of the commands, command logic out of the roles
}


def test_layers_hold_except_the_allowlist():
    """No new layer violation or cycle; every allowlisted edge still exists and still breaks a rule."""
    graph = import_graph(ROOT, PACKAGES)
    new, stale = check(graph, LAYERS, MAY_IMPORT, FORBIDDEN_EXTERNAL, ALLOWED)
    assert not new, f"new layer violations (kind, module, imported): {sorted(new)}; see docs/design.md 'Layers'"
    assert not stale, f"allowlisted edges that no longer break a rule, remove them from ALLOWED: {sorted(stale)}"


def test_the_graph_sees_function_local_and_submodule_imports():
    """The checker reads what the rules depend on: a function-local import, ``from pkg import submodule``."""
    graph = import_graph(ROOT, PACKAGES)
    assert "distrl.rollout.engines.hf" in graph.edges["distrl.rollout.engines"]  # make_engine's function-local import
    assert "torch" in graph.external["distrl.core.dtypes"]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_reports_exactly_the_violations_of_a_fixture_package(tmp_path):
    """A role importing a command (inside a function), a cycle through ``from . import x``, torch in the
    buffer and an unclassified module are reported, each once; legal imports are not; an allowlisted edge
    is not reported, and one that is no longer broken is stale."""
    _write(tmp_path, {
        "app/__init__.py": "",
        "app/core.py": "import json\n",
        "app/cmd.py": "from app import core\nimport store.keep\n",
        "app/stray.py": "",
        "role/__init__.py": "",
        "role/worker.py": "from app.core import x\n\ndef run():\n    from app.cmd import main\n",
        "role/a.py": "from . import b\n",
        "role/b.py": "def f():\n    from role.a import g\n",
        "store/__init__.py": "",
        "store/keep.py": "import torch.nn\nfrom app import core\n",
    })
    layers = {"app": "foundation", "app.core": "foundation", "app.cmd": "command",
              "role.*": "role", "store.*": "store"}
    may_import = {"foundation": {"foundation"}, "role": {"foundation", "role"}, "store": {"foundation", "store"},
                  "command": {"foundation", "role", "store", "command"}}
    graph = import_graph(tmp_path, ["app", "role", "store"])
    assert graph.edges["role.worker"] == {"app.core", "app.cmd"}
    assert graph.edges["app.cmd"] == {"app.core", "store.keep"}

    new, stale = check(graph, layers, may_import, {"store": {"torch"}}, {})
    assert new == {("layer", "role.worker", "app.cmd"), ("cycle", "role.a", "role.b"), ("cycle", "role.b", "role.a"),
                   ("external", "store.keep", "torch"), ("unclassified", "app.stray", "")}
    assert stale == set()

    allow = {("role.worker", "app.cmd"): "fixture", ("role.b", "role.a"): "fixture", ("app.cmd", "app.core"): "legal"}
    new, stale = check(graph, layers, may_import, {"store": {"torch"}}, allow)
    assert new == {("external", "store.keep", "torch"), ("unclassified", "app.stray", "")}
    assert stale == {("app.cmd", "app.core")}
