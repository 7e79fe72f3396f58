"""The run's environment variables, for `kiln triage`'s replay: a plugin may read any of them
(a feature switch, a scale), and a replay without them can take another path than the run did.
Each run writes <run>/environment.json: every variable's value, except those whose name says it
holds a secret (a key, a token, a password): of those only a digest, so a replay can say that it
differs without the file holding it. The replay sets the recorded values for its duration and
says which ones differed (and which secrets it could not restore)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import first_few

ENVIRONMENT_FILE = "environment.json"
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|AUTH|COOKIE|SESSION", re.I)
DIGEST = "sha256:"
# Not restored: kiln's own (KILN_*: the run's config already holds what they changed), the
# launcher's (torchrun's, PYTHON_EXEC its ranks' interpreter: a replay is one process), the
# shell's bookkeeping and the test runner's.
IGNORED = re.compile(
    r"^(KILN_|TORCHELASTIC_|PYTEST_|(LOCAL_|GROUP_|ROLE_)?RANK$|(LOCAL_|GROUP_|ROLE_)?WORLD_SIZE$"
    r"|ROLE_NAME$|MASTER_(ADDR|PORT)$|PYTHON_EXEC$|PWD$|OLDPWD$|SHLVL$|_$)"
)


def recorded(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    return {
        name: DIGEST + hashlib.sha256(value.encode()).hexdigest()[:16]
        if SECRET.search(name)
        else value
        for name, value in sorted(environ.items())
    }


def write_environment(run_dir: Path) -> None:
    """Best effort: a run does not fail for want of this record."""
    with contextlib.suppress(OSError):
        (Path(run_dir) / ENVIRONMENT_FILE).write_text(json.dumps(recorded(), indent=1) + "\n")


def read_environment(run_dir: Path) -> dict[str, str] | None:
    path = Path(run_dir) / ENVIRONMENT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def run_environment(run_dir: Path) -> Iterator[list[str]]:
    """Inside: os.environ as the run had it (recorded values set, variables the run did not
    have removed), secrets aside. Yields notes on what differed; restores os.environ after."""
    saved = read_environment(run_dir)
    if saved is None:
        yield [f"the run recorded no environment ({ENVIRONMENT_FILE}): replayed with this one"]
        return
    now = recorded()
    before = dict(os.environ)
    notes, restored, secrets = [], [], []
    try:
        for name in sorted(set(saved) | set(now)):
            then, current = saved.get(name), now.get(name)
            if then == current or IGNORED.match(name):
                continue
            if (then or "").startswith(DIGEST) or (current or "").startswith(DIGEST):
                secrets.append(name)
                continue
            if then is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = then
            restored.append(f"{name}={then if then is not None else '(unset)'}")
        if restored:
            notes.append(f"replayed with the run's environment: {first_few(restored, 8)}")
        if secrets:
            notes.append(
                f"this environment differs from the run's in {', '.join(secrets)} (secrets: "
                "their values are not recorded, the replay uses these)"
            )
        yield notes
    finally:
        os.environ.clear()
        os.environ.update(before)
