"""README.md and docs/ as a reader meets them: every relative link leads to a file, the README stays one page,
and it gives the test command CI runs (.ci/run, whose pytest line is .ci/TEST_COMMAND). Reads text only: no torch."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: pathlib.Path) -> list[str]:
    """The targets of ``[text](target)`` links that name a file of this repository (not a URL, not an anchor)."""
    targets = [m.group(1) for m in LINK.finditer(page.read_text())]
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_lead_to_files(page: pathlib.Path) -> None:
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_is_one_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; issue 66 keeps it at most 300: move detail to docs/"


def test_readme_gives_the_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "```sh\nbash .ci/run\n```" in readme, "README.md should give the test command as CI runs it: bash .ci/run"
    assert (ROOT / ".ci" / "TEST_COMMAND").read_text().strip(), ".ci/TEST_COMMAND holds the pytest line .ci/run runs"


def _design_sections() -> dict[str, str]:
    """docs/design.md's map: folder -> the text of its section (``**`folder/`**`` up to the next folder)."""
    text = (ROOT / "docs" / "design.md").read_text()
    parts = re.split(r"^\*\*`([a-z_/]+)/`\*\*.*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_design_names_every_module_in_its_folder() -> None:
    """The map of docs/design.md has a line for every module, under its own folder (issue 66): a module added,
    moved or renamed without its line fails here. (The lines are the modules' docstrings' first sentences.)"""
    sections = _design_sections()
    folders = [ROOT / "fxshard", ROOT / "lowering", ROOT / "backend",
               *sorted(p for p in (ROOT / "backend").iterdir() if (p / "__init__.py").is_file())]
    missing = [f"{folder.relative_to(ROOT).as_posix()}/{f.name}" for folder in folders for f in sorted(folder.glob("*.py"))
               if f"- `{f.name}`:" not in sections.get(folder.relative_to(ROOT).as_posix(), "")]
    assert not missing, f"docs/design.md's map lacks: {missing}"
    stale = sorted(set(sections) - {folder.relative_to(ROOT).as_posix() for folder in folders})
    assert not stale, f"docs/design.md maps folders that do not exist: {stale}"
