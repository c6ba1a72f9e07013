"""The README's index of `docs/` cannot fall behind: every page in docs/ has its line there."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_indexes_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    index = readme.split("## Documentation")[1]
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"`docs/{p.name}`:" not in index]
    assert not missing, "add a line for these to the README's docs index: " + ", ".join(missing)
