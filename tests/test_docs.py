"""The README stays a few screens long and runs what CI runs; every relative link in it and in docs/
points at a file of the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
QUICK_START = ('pip install torch==2.13.0 -e . && python data/enwik8/prepare.py && python train.py --preset cpu',
               'pip install torch==2.13.0 -e ".[dev]" && python -m pytest')
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def links(page: Path) -> list[str]:
    """The repository paths that `page`'s relative markdown links name."""
    return [str((page.parent / target).resolve().relative_to(ROOT)) for target in LINK.findall(page.read_text())
            if "://" not in target]


def test_the_readme_fits_on_a_few_screens():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_holds_both_quick_start_commands_and_ci_runs_the_second():
    text = README.read_text()
    assert all(f"    {command}\n" in text for command in QUICK_START)
    assert QUICK_START[1] in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(page):
    missing = [target for target in links(page) if not (ROOT / target).exists()]
    assert missing == [], f"{page.name} links to files that do not exist: {missing}"


def test_a_link_is_read_with_or_without_an_anchor():
    assert LINK.findall("[a](docs/numerics.md#rmsnorm) [b](https://x.org) [c](results/)") == [
        "docs/numerics.md", "https://x.org", "results/"]
