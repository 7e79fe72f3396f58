"""README.md and docs/ document what the repo has, and stay true to it: the README is short and
lists every page; the generated pages (the config reference, the layout, the README's docs
index) are fresh; every relative link and anchor resolves; every code excerpt is still the text
of the file it names; every config option and make target is documented."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest

from kiln.cli import docs
from kiln.cli.paths import CONF_DIR, REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 250
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n```[a-z]*\n(.*?)\n```", re.S)


def _id(page: Path) -> str:
    return page.relative_to(REPO_ROOT).as_posix()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a link may name in a page: its headings' slugs (numbered when repeated, as
    GitHub numbers them) and explicit <a id="...">."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.*)", line)):
            base, n = slug(heading.group(1)), 0
            while (name := base if n == 0 else f"{base}-{n}") in found:
                n += 1
            found.add(name)
    found.update(re.findall(r'<a id="([^"]+)"', page.read_text()))
    return found


def test_the_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_the_generated_pages_and_the_docs_index_are_fresh():
    """docs/config-reference.md (from the schemas' field comments), docs/layout.md (from the
    modules' docstrings) and the README's index of docs/ equal what the generator writes."""
    stale = docs.stale()
    assert stale == [], f"stale: {', '.join(stale)}; regenerate with `{docs.COMMAND}`"


def test_a_smoke_run_writes_no_figure_of_the_docs(tmp_path, monkeypatch):
    """Under KILN_SMOKE=1 (the docs' commands and `make bench`, run as typed by the tests in
    their quick form) a bench script's --out into docs/figures/ is left alone: a smoke run's
    numbers are no figure of the docs. Anywhere else the report is written."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    from provenance import write_report

    monkeypatch.setenv("KILN_SMOKE", "1")
    never = DOCS / "figures" / "a-smoke-run.json"
    assert write_report({}, "| a |", never) == "| a |\n" and not never.exists()
    elsewhere = tmp_path / "a-smoke-run.json"
    write_report({}, "| a |", elsewhere)
    assert json.loads(elsewhere.read_text())["markdown"] == "| a |\n"


def test_the_readme_lists_every_docs_page():
    text = README.read_text()
    assert [p.name for p in DOCS.glob("*.md") if f"(docs/{p.name})" not in text] == []


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_relative_link_and_anchor_resolves(page):
    dead = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code are code
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            dead.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            dead.append(f"{target}: no heading or <a id> {anchor!r} in {_id(where)}")
    assert dead == []


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_code_excerpt_matches_the_file_it_names(page):
    """A fenced block right after `<!-- excerpt: <path from the repo root> -->` must appear,
    verbatim, in that file."""
    drifted = []
    for path, excerpt in EXCERPT.findall(page.read_text()):
        source = REPO_ROOT / path
        if not source.is_file():
            drifted.append(f"{path}: no such file")
        elif excerpt not in source.read_text():
            drifted.append(f"{path}: the excerpt is no longer in it")
    assert drifted == []


def test_the_excerpt_convention_is_used():
    assert EXCERPT.search(README.read_text()), "README.md shows the plugin as a checked excerpt"


def test_every_config_option_is_documented():
    text = "\n".join(p.read_text() for p in PAGES)
    missing = [
        f"{group.name}={option.stem}"
        for group in CONF_DIR.iterdir()
        if group.is_dir() and group.name != "hydra"
        for option in group.glob("*.yaml")
        if f"`{option.stem}`" not in text
    ]
    assert missing == []


def test_every_make_target_is_documented():
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = re.findall(r"^([a-z-]+): .*## ", makefile, flags=re.MULTILINE)
    assert {"install", "train", "test", "sweep", "export", "serve", "bench", "doctor"} <= set(
        targets
    )
    development = (DOCS / "development.md").read_text()
    assert [t for t in targets if f"make {t}" not in development] == []


def test_the_two_commands_come_first():
    first_block = README.read_text().split("## train.py and infer.py")[0]
    assert "make train" in first_block and "make test" in first_block


ABSOLUTE_RUN_PATH = re.compile(r"(?<![\w.~])/(?:work|root|Users|tmp/pytest-of-\w+)/\S+")


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_no_page_shows_a_path_of_the_machine_it_was_written_on(page):
    """Runs shown in README and docs print paths relative to where they ran (outputs/...): a
    developer's checkout (/work/..., /root/..., /Users/...) or a test's tmp dir is a leak."""
    text = page.read_text()
    leaks = [m.group(0) for m in ABSOLUTE_RUN_PATH.finditer(text)]
    leaks += [str(REPO_ROOT)] if str(REPO_ROOT) in text else []
    assert leaks == [], f"{_id(page)} shows machine paths: {leaks[:5]}"
