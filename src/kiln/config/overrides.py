"""Hydra's override grammar, both ways: values written so that Hydra reads them back unchanged
(every command kiln prints: a path holding spaces, commas, `=`, quotes or `~` is quoted), and
command-line overrides Hydra cannot parse explained in one line with the quoting that works."""

from __future__ import annotations

import functools
import re
import shlex
from typing import Any

from kiln.config.base import ConfigError

_PLAIN = re.compile(r"[\w./:+-]+")  # reads back as itself unquoted (when not a number or bool)


@functools.cache
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _reads_back(key: str, text: str, value: Any) -> bool:
    from hydra.errors import HydraException

    try:
        parsed = _parser().parse_overrides([f"{key}={text}"])[0]
    except HydraException:
        return False
    return not parsed.is_sweep_override() and parsed.value() == value


def override_value(value: Any, key: str = "key") -> str:
    """`value` as Hydra's override grammar writes it: null, true/false, a list in brackets, a
    plain word as it is, any other string quoted (double quotes, or single ones when that
    reads back better) -- checked by parsing it back with Hydra's own parser."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_value(v, key) for v in value) + "]"
    if not isinstance(value, str):
        return str(value)
    if _PLAIN.fullmatch(value) and _reads_back(key, value, value):
        return value
    # Hydra's quoted strings: a quote of their own kind escaped; a backslash is literal unless
    # it precedes a quote (then doubled): both spellings are tried, and the one read back kept.
    for quote in ('"', "'"):  # double first: a printed command wraps it in single quotes
        for backslash in ("\\", "\\\\"):
            body = value.replace("\\", backslash).replace(quote, "\\" + quote)
            if _reads_back(key, quote + body + quote, value):
                return quote + body + quote
    raise ValueError(f"{value!r} cannot be written as a Hydra override value")


def override(key: str, value: Any) -> str:
    """`key=value`, the value written so Hydra reads it back (see override_value)."""
    return f"{key}={override_value(value, key)}"


# Hydra's flags that take the next argument as their value (`--info` optionally).
_FLAGS_WITH_A_VALUE = frozenset(
    ("--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp")
    + ("--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun")
)


def check_grammar(argv: list[str]) -> None:
    """Every key=value argument parsed by Hydra's own parser before anything else runs;
    ConfigError (one line, the quoting that works) for the first it cannot read."""
    from hydra.errors import OverrideParseException

    flag_value = False
    for arg in argv:
        if flag_value and not arg.startswith("-") and "=" not in arg:
            flag_value = False
            continue  # a flag's own value: --cfg job, --info searchpath
        flag_value = arg in _FLAGS_WITH_A_VALUE
        if arg.startswith("-"):
            continue  # flags: -m, --help, --cfg job
        try:
            _parser().parse_overrides([arg])
        except OverrideParseException as err:
            raise grammar_error(arg, err) from None


def grammar_error(arg: str, err: Exception) -> ConfigError:
    """Hydra's parse error for `arg` as one line: what it could not read, and the argument
    quoted for Hydra (inside) and for the shell (outside), e.g. 'init_from="~/w.pt"'."""
    key, sep, value = arg.partition("=")
    if not sep:
        return ConfigError(
            f"{arg!r} is not an override",
            "",
            "write each override as key=value (a value with spaces in quotes for the shell: "
            "'key=a b'), or ~key to delete one; --help lists the keys",
        )
    lines = str(err).splitlines()
    culprit = _culprit(arg, lines)
    why = (
        f"{culprit!r} cannot stand unquoted in a value"
        if culprit
        else lines[0].replace("LexerNoViableAltException: ", "")
    )
    if value.startswith(("[", "{")):
        return ConfigError(
            f"Hydra's override grammar cannot read {arg} ({why})",
            key.lstrip("+~"),
            "close the list or dict ([a,b], {k:v}), quoting items that hold other characters",
        )
    quoted = '"' + value.replace('"', '\\"') + '"'  # double quotes inside, as people type them
    if not _reads_back(key, quoted, value):
        quoted = override_value(value, key)
    example = shlex.quote(f"{key}={quoted}")
    return ConfigError(
        f"Hydra's override grammar cannot read {arg} ({why})",
        key.lstrip("+~"),
        f"quote the value for Hydra, inside quotes for the shell: {example}",
    )


def _culprit(arg: str, lines: list[str]) -> str | None:
    """The character or token Hydra stopped at: under the caret of a lexer error, or the
    `input '...'` a parser error names."""
    prefix = "LexerNoViableAltException: "
    if lines and lines[0].startswith(prefix) and len(lines) > 1 and "^" in lines[1]:
        at = lines[1].index("^") - len(prefix)
        return arg[at] if 0 <= at < len(arg) else None
    found = re.search(r"input '([^']*)'", lines[0]) if lines else None
    return found.group(1) if found else None
