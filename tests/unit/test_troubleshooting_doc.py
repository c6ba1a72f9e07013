"""docs/troubleshooting.md cannot fall behind: every `PreflightError(flag, problem, fix)` raised in the
source appears there as `flag: problem`, with each `{...}` of an f-string written as `<...>` (its
expression, e.g. `--model: <value>: no such directory`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("distrl",)  # the roles included: distrl/rollout, distrl/learn, distrl/buffer


def _text(node: ast.expr) -> str:
    """A string literal as written, each f-string placeholder as `<expression>`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(part) if isinstance(part, ast.Constant) else f"<{ast.unparse(part.value)}>"
                       for part in node.values)
    raise AssertionError(f"not a string literal: {ast.unparse(node)}")


def preflight_messages() -> list[tuple[str, str]]:
    """(file:line, `flag: problem`) of every PreflightError(...) call in the packages."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PreflightError":
                    args = {**dict(zip(("flag", "problem", "fix"), node.args)),
                            **{k.arg: k.value for k in node.keywords}}
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    found.append((where, f"{_text(args['flag'])}: {_text(args['problem'])}"))
    return found


def test_every_preflight_message_is_in_the_troubleshooting_doc():
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    messages = preflight_messages()
    # the checks of distrl/core/hub.py, the role preflights, distrl/cmd/preflight.py, prompt_fit
    assert len(messages) >= 20
    missing = [f"{where}: {message}" for where, message in messages if message not in doc]
    assert not missing, "add these to docs/troubleshooting.md:\n" + "\n".join(missing)


def test_readme_links_the_troubleshooting_doc():
    assert "docs/troubleshooting.md" in (ROOT / "README.md").read_text()
