"""Every command in docs/*.md runs as typed, page by page (`make test-all`): each page in its own
fresh checkout, its commands in order, so a page that predicts from `outputs/latest` trains
first. tests/markdown_commands.py says how commands are found, shortened (KILN_OVERRIDES,
KILN_SMOKE only) and which few cannot run here. A page added to docs/ is picked up by the
parametrization with no edit here."""

from __future__ import annotations

import os
import subprocess

import pytest

from kiln.cli.paths import REPO_ROOT

from .conftest import MAKE_VARIABLES
from .markdown_commands import (
    Command,
    commands,
    environment,
    placeholders,
    recipe,
    run,
    run_all,
    run_elsewhere,
    to_run,
    user_checkout,
)

PAGES = sorted((REPO_ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_docs_name_no_placeholder_in_a_command(page):
    assert placeholders(commands(page.read_text())) == []


MISTAKES = [(p, c) for p in PAGES for c in commands(p.read_text()) if c.expected]


@pytest.mark.slow
@pytest.mark.parametrize("page, command", MISTAKES, ids=lambda x: getattr(x, "name", None))
def test_the_mistakes_the_docs_show_print_what_they_show(tmp_path, page, command):
    home = user_checkout(tmp_path)
    env = environment(home)
    del env["KILN_OVERRIDES"]  # exactly as typed: these stop before any work anyway
    run(command, home, env)


@pytest.mark.slow
@pytest.mark.timeout(5400)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_of_a_docs_page_runs_as_typed(tmp_path, page):
    home = user_checkout(tmp_path)
    run_all(commands(page.read_text()), home, environment(home), page.name)


def test_a_command_run_elsewhere_runs_once_on_the_page_that_documents_it():
    """make bench and make matrix run in full once (docs/benchmarks.md, tests/test_matrix.py);
    docs/development.md's list of make targets skips them, saying where they run."""
    bench, matrix = Command("make bench"), Command("make matrix")
    assert run_elsewhere(bench, "benchmarks.md") is None
    assert run_elsewhere(bench, "development.md") == "docs/benchmarks.md runs it as typed"
    assert run_elsewhere(matrix, "development.md").startswith("tests/test_matrix.py runs")
    assert run_elsewhere(Command("make doctor"), "development.md") is None
    assert run_elsewhere(matrix, None) is not None  # the README's commands: no page
    listed = {c.line for c in commands((REPO_ROOT / "docs" / "benchmarks.md").read_text())}
    assert "make bench" in listed  # where it runs, it is still typed


def test_a_line_a_make_target_ran_on_the_page_is_not_run_again():
    """`make bench` runs bench_text.py's and bench_startup.py's lines as docs/benchmarks.md
    shows them again: run once, by make bench; a line before it, or another line, still runs."""
    text_line = "python scripts/bench_text.py --fasttext venv --contention 1"
    startup_line = "python scripts/bench_startup.py --out docs/figures/startup.json"
    assert {text_line, startup_line} <= set(recipe("bench"))
    assert recipe("train") == ["python train.py"]
    with pytest.raises(ValueError, match="the Makefile has no target 'trian'"):
        recipe("trian")  # a page's typo is named, not a bare StopIteration
    page = [startup_line, "make bench", text_line, "python scripts/bench_text.py --rows 10"]
    chosen = [c.line for c in to_run([Command(line) for line in page], "benchmarks.md")]
    assert chosen == [startup_line, "make bench", "python scripts/bench_text.py --rows 10"]
    on_the_page = [
        c.line
        for c in to_run(
            commands((REPO_ROOT / "docs" / "benchmarks.md").read_text()), "benchmarks.md"
        )
    ]
    assert "make bench" in on_the_page and text_line not in on_the_page


def test_a_make_command_on_a_page_gets_none_of_the_suites_own_make_arguments(tmp_path):
    """`make test-all ARGS=...` once failed every page with a `make` command: make passes its
    command line's variables down in MAKEFLAGS, so a page's `make sweep` took pytest's options
    as overrides. tests/conftest.py drops make's variables from the suite's environment (under
    `make test` MAKELEVEL is always there)."""
    assert not set(MAKE_VARIABLES) & set(os.environ)
    home = user_checkout(tmp_path)
    env = environment(home)
    as_under_make = {**env, "MAKEFLAGS": " -- ARGS=--basetemp=/tmp/x", "MAKELEVEL": "1"}
    for given, leaks in ((as_under_make, True), (env, False)):
        shown = subprocess.run(
            ["make", "-n", "sweep"], cwd=home, env=given, capture_output=True, text=True
        )
        assert shown.returncode == 0, shown.stderr
        assert ("--basetemp=/tmp/x" in shown.stdout) is leaks, shown.stdout
