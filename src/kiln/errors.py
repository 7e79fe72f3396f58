"""UserError marks the mistakes a user can fix (a config value, a CSV row, a checkpoint path):
the command line prints them as one line, `error: <what> (<where>): <what to do>`, with exit code
2 and no traceback. Anything else is a bug in kiln or in a model, and keeps its traceback."""

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def attempt(run: Callable[..., T], *args: Any) -> tuple[T | None, Exception | None]:
    """(run(*args), None), or (None, what it raised): the one place kiln runs code it did not
    write (a model, a loss, a builder, a library) that may raise anything, keeping the error for
    the caller to classify -- a check's finding, a reason it cannot run, a count left out --
    never kiln's own crash. Ctrl-C and SystemExit pass through."""
    try:
        return run(*args), None
    except Exception as err:  # the user's code may raise anything: the caller classifies it
        return None, err


class UserError(Exception):
    """Base of every user-fixable error class (mixed in beside ValueError, RuntimeError...)."""


def did_you_mean(
    word: str,
    choices: Iterable[str],
    *,
    spell: Callable[[str], str] = str,
    most: int = 1,
    cutoff: float = 0.6,
) -> str:
    """The one way kiln suggests a name for a mistyped `word`: "; did you mean X?" (or "X or
    Y?"), the closest of `choices` written as the user would type them (`spell`: "model=mlp",
    "data.image_size"), for the end of a message's what-to-do part; "" when none is close."""
    import difflib

    choices = list(choices)
    same_letters = [c for c in choices if c.casefold() == word.casefold() and c != word]
    # a name in the wrong case is that name, however long (a hub id: org/All-MiniLM-L6-v2)
    close = same_letters[:most] or difflib.get_close_matches(word, choices, n=most, cutoff=cutoff)
    return f"; did you mean {' or '.join(spell(c) for c in close)}?" if close else ""


def first_few(items: Iterable, most: int = 6) -> str:
    """How a message names a long list: the first `most` items, comma-joined, then " and N
    more"."""
    shown = [str(item) for item in items]
    rest = len(shown) - most
    return ", ".join(shown[:most]) + (f" and {rest} more" if rest > 0 else "")


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named (a checkpoint, an input, an export) is not there."""


class DiskFullError(UserError, OSError):
    """A write found its disk full (no space left, or the quota spent). The message names the
    file and what to do; what was written before (checkpoints above all) is intact."""


def is_disk_full(err: BaseException | None) -> bool:
    import errno

    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def free_space(path) -> str:
    """The free space of the disk holding `path`, for a person ("12 KiB free")."""
    import shutil
    from pathlib import Path

    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:.1f} MiB free" if free >= 2**20 else f"{free // 1024} KiB free"


def disk_full(path, what: str = "") -> DiskFullError:
    """The one-line error for a write to `path` that hit a full disk."""
    from pathlib import Path

    path = Path(path)
    return DiskFullError(
        f"no space left on the device writing {what or path.name} ({path}; {free_space(path)}) "
        f"({path.parent}): free space on that disk, or run with hydra.run.dir on another one; "
        "nothing written before is lost"
    )
