"""The README documents what the repo has: every config option and every make target."""

from __future__ import annotations

import re

from kiln.cli.paths import CONF_DIR, REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def test_every_config_option_is_in_the_readme():
    missing = [
        f"{group.name}={option.stem}"
        for group in CONF_DIR.iterdir()
        if group.is_dir() and group.name != "hydra"
        for option in group.glob("*.yaml")
        if f"`{option.stem}`" not in README
    ]
    assert missing == []


def test_every_make_target_is_in_the_readme():
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = re.findall(r"^([a-z-]+): .*## ", makefile, flags=re.MULTILINE)
    assert {"install", "train", "test", "sweep", "export", "serve", "bench", "doctor"} <= set(
        targets
    )
    assert [t for t in targets if t not in README] == []


def test_the_two_commands_come_first():
    first_block = README.split("## Command-line cookbook")[0]
    assert "make train" in first_block and "make test" in first_block
