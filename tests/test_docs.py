"""The README stays a few screens long and runs what CI runs; every relative link in it and in docs/
points at a file of the repository; every name of this project they quote exists in the code, and none
cites an issue number (nothing in the repository resolves one)."""
from __future__ import annotations

import functools
import re
import subprocess
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


SPAN = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
# a repository path: from a top folder (linattn/, docs/, ...; ops/ from linattn/), or a source file's name
PATH = re.compile(r"\b(?:(?:linattn|linattn_lm|benchmarks|tests|docs|data|ops|models)/[\w.+=/-]*"
                  r"|[\w./-]+\.(?:py|cpp|sh|toml|md)\b)")
CAMEL = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+")
# Names the docs quote that are not this project's: other packages' modules, keywords and values, and
# the placeholders of examples.
EXTERNAL_MODULES = {"torch", "fla", "triton", "numpy", "np", "xformers", "tomllib", "pytest", "F", "nn"}
EXTERNAL_NAMES = {"same_as_forward", "my_map", "test_x"}
EXTERNAL_PATHS = {"tests/path/test_x.py", "my.toml"}   # examples' own files


@functools.cache
def tracked_files() -> tuple[str, ...]:
    """The repository's files as they are in the working tree (new ones too, removed ones not)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return tuple(name for name in dict.fromkeys(listed) if (ROOT / name).is_file())


@functools.cache
def code_text() -> str:
    """The project's code: every tracked source file but this one (its examples of drift must stay missing);
    the docs are not code, they must not vouch for themselves."""
    return "\n".join((ROOT / name).read_text() for name in tracked_files() if name != "tests/test_docs.py" and (
        name.endswith((".py", ".sh", ".toml", ".cpp")) or name == ".ci/run"))


@functools.cache
def code_names() -> frozenset[str]:
    return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code_text()))


@functools.cache
def command_flags() -> frozenset[str]:
    """The flags of train.py, grid.py and eval.py (generated from the settings' fields), of the benchmarks,
    and every flag spelled out in the code (grid.py's own, the scripts')."""
    from benchmarks.settings import build_parser as benchmark_parser
    from linattn_lm.evaluate import build_parser as eval_parser
    from linattn_lm.flags import build_parser
    parsers = (build_parser(), eval_parser(), benchmark_parser())
    generated = {flag for parser in parsers for action in parser._actions for flag in action.option_strings}
    return frozenset(generated | set(FLAG.findall(code_text())))


def is_project_name(word: str) -> bool:
    """snake_case or CamelCase: what this project names its functions, settings, classes and modules."""
    return "_" in word.strip("_") or CAMEL.fullmatch(word) is not None


def path_exists(path: str) -> bool:
    """A repository path, from the root or from any folder (docs say `ops/window_decay/band.py`), or a
    file the code writes (`results.md`), or a placeholder in capitals (`OUT.md`)."""
    path = path.rstrip("/")
    name = path.rsplit("/", 1)[-1]
    return (ROOT / path).exists() or any(file == path or file.endswith("/" + path) or f"/{path}/" in f"/{file}"
                                         for file in tracked_files()) or (
        "/" not in path and (f'"{name}"' in code_text() or name.split(".")[0].isupper()))


def missing_names(text: str) -> list[str]:
    """The names that backticked spans of `text` quote and the code lacks: paths, flags, and the
    snake_case and CamelCase parts of names and dotted names (those of other packages left out)."""
    missing = []
    for span in SPAN.findall(text):
        for path in PATH.findall(span):
            if "://" not in span and path not in EXTERNAL_PATHS and not path_exists(path):
                missing.append(path)
        rest = PATH.sub(" ", span)
        missing += [flag for flag in FLAG.findall(rest) if flag not in command_flags()]
        for name in NAME.findall(FLAG.sub(" ", rest)):
            parts = name.split(".")
            if parts[0] in EXTERNAL_MODULES:
                continue
            missing += [part for part in parts if is_project_name(part) and part not in code_names()
                        and part not in EXTERNAL_NAMES]
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_quoted_name_of_the_project_exists_in_the_code(page):
    missing = missing_names(page.read_text())
    assert missing == [], f"{page.name} quotes names the code does not have: {sorted(set(missing))}"


def test_a_renamed_function_flag_or_file_is_caught_and_other_packages_names_are_not():
    assert missing_names("`linattn_lm/config.py` (`block_option_parts`), `--windw`, `WindowStat`") == [
        "linattn_lm/config.py", "block_option_parts", "--windw", "WindowStat"]
    assert missing_names("`torch.compile(fullgraph=True)`, `fla.ops.chunk_gla`, `--window 64`, `window=W`, "
                         "`linattn.functional.linear_attention`, `ops/window_decay/band.py`, `e^s`") == []


ISSUE = re.compile(r"\bissues? \d+|#\d+\b", re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_cites_an_issue_number(page):
    cited = ISSUE.findall(page.read_text())
    assert cited == [], f"{page.name} cites issue numbers, which nothing in the repository resolves: {cited}"


def test_an_issue_citation_is_found():
    assert ISSUE.findall("issue 45, issues 8 and #34; not 4096 or a #-comment") == ["issue 45", "issues 8", "#34"]
