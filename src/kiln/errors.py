"""UserError marks the mistakes a user can fix (a config value, a CSV row, a checkpoint path):
the command line prints them as one line, `error: <what> (<where>): <what to do>`, with exit code
2 and no traceback. Anything else is a bug in kiln or in a model, and keeps its traceback."""


class UserError(Exception):
    """Base of every user-fixable error class (mixed in beside ValueError, RuntimeError...)."""


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
