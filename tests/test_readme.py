"""README.md runs as typed, in the default suite: every command of its code blocks, in order, in a
fresh folder laid out like a clone (tests/markdown_commands.py says how; KILN_OVERRIDES and
KILN_SMOKE are the only shortening). The README keeps to commands that take seconds; the long
ones live in docs/, run page by page by tests/test_docs_commands.py under `make test-all`."""

from __future__ import annotations

import pytest

from kiln.cli.paths import REPO_ROOT

from .markdown_commands import commands, environment, placeholders, run, run_all, user_checkout

README = REPO_ROOT / "README.md"
ALL = commands(README.read_text())


def test_the_readme_names_no_placeholder_in_a_command():
    assert placeholders(ALL) == []


@pytest.mark.parametrize("command", [c for c in ALL if c.expected], ids=lambda c: c.line)
def test_the_mistakes_the_readme_shows_print_what_it_shows(tmp_path, command):
    home = user_checkout(tmp_path)
    env = environment(home)
    del env["KILN_OVERRIDES"]  # exactly as typed: these stop before any work anyway
    run(command, home, env)


@pytest.mark.timeout(900)
def test_every_command_in_the_readme_runs_as_typed(tmp_path):
    home = user_checkout(tmp_path)
    ran = run_all(ALL, home, environment(home))
    skipped = [c.line for c in ALL if c.skip_reason]
    assert skipped == ["make test"], "the README's commands must all run in the default suite"
    assert len(ran) >= 11, ran  # `python train.py` is `make train`'s line: run once (to_run)
