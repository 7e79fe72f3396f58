"""A large JSON object read member by member, its arrays element by element, so that memory holds
one element at a time (and what the caller keeps of it), never the whole document: a COCO
instances file is mostly segmentation polygons, which `json.load` turns into tens of millions of
Python floats (a 300 MB file took 4.7 GB) and data=coco never reads.

    stream = JsonStream(text_file, max_value_chars=64 * 2**20)
    for key in stream.members():          # the top-level object's keys, in file order
        if key == "images":
            for image in stream.elements():   # each element parsed whole, then let go
                ...
        else:
            stream.skip()                 # every member's value must be read or skipped

Each value is parsed by the standard library's decoder (`raw_decode` on a buffer read 1 Mi
characters at a time), so the values are what json.loads gives. Bounded: one value longer than
`max_value_chars` is an error (the buffer grows to hold one value, never the document), and so
is a value nested deeper than the decoder's recursion allows (a RecursionError inside json)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

CHUNK_CHARS = 1 << 20  # characters read at a time
CUT_MARGIN = 1024  # a decode error this near the buffer's end may be the end's cut: read on
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _maybe_cut(value: Any, buf: str, end: int) -> bool:
    """Whether a number may go on past the buffer's end ("1e-" read as 1): a number is whole
    once a character that cannot continue it follows."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    return end >= len(buf) or buf[end] in "0123456789.eE+-"


class JsonStreamError(ValueError):
    """Malformed or unbounded JSON; the message says what, and where (line and column)."""


class JsonStream:
    def __init__(self, file: TextIO, max_value_chars: int):
        self.file, self.max_value_chars = file, max_value_chars
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.column = 1, 1  # where buf[0] is in the file

    # --- the structure ------------------------------------------------------------------------

    def members(self) -> Iterator[str]:
        """The top-level object's keys in file order; the caller reads each one's value (with
        `elements`, `value` or `skip`) before asking for the next key."""
        self._expect("{", "the file to hold a JSON object")
        if self._peek() == "}":
            self.pos += 1
        else:
            while True:
                key = self.value()
                if not isinstance(key, str):
                    raise self._error("expected a key (a string)")
                self._expect(":", "':' after a key")
                yield key
                if self._expect(",}", "',' or '}' after a value") == "}":
                    break
        if self._peek():
            raise self._error("more data after the end of the object")

    def next_is_array(self) -> bool:
        return self._peek() == "["

    def elements(self) -> Iterator[Any]:
        """The elements of the array that comes next, each parsed whole when it is reached."""
        self._expect("[", "an array")
        if self._peek() == "]":
            self.pos += 1
            return
        while True:
            yield self.value()
            if self._expect(",]", "',' or ']' after an array element") == "]":
                return

    def skip(self) -> None:
        """Passes over the value that comes next (an array element by element)."""
        if self.next_is_array():
            for _ in self.elements():
                pass
        else:
            self.value()

    def value(self) -> Any:
        """The next JSON value, parsed whole."""
        self._peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
                if self.eof or not _maybe_cut(value, self.buf, end):
                    self.pos = end
                    return value
            except json.JSONDecodeError as err:
                # More of the file can mend only what the buffer's end cut (a string left open
                # may start anywhere); a mistake well before the end is the file's own.
                cut = err.pos >= len(self.buf) - CUT_MARGIN or err.msg.startswith("Unterminated")
                if self.eof or not cut:
                    raise self._error(err.msg, err.pos) from None
            except RecursionError:
                raise self._error(
                    f"a value nested deeper than the JSON reader goes (about "
                    f"{sys.getrecursionlimit():,} levels)"
                ) from None
            if len(self.buf) - self.pos > self.max_value_chars:
                raise self._error(f"one value is longer than {self.max_value_chars:,} characters")
            self._read(len(self.buf) - self.pos)  # at least doubles what is held: linear

    # --- the buffer ---------------------------------------------------------------------------

    def _read(self, at_least: int) -> bool:
        """More of the file after what is held (what was read is let go); False at its end."""
        if self.eof:
            return False
        if self.pos:
            done = self.buf[: self.pos]
            lines = done.count("\n")
            self.line += lines
            self.column = self.pos - done.rfind("\n") if lines else self.column + self.pos
            self.buf, self.pos = self.buf[self.pos :], 0
        data = self.file.read(max(CHUNK_CHARS, at_least))
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def _peek(self) -> str:
        """The next character that is not white space ("" at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self._read(0):
                return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def _expect(self, chars: str, what: str) -> str:
        found = self._peek()
        if not found or found not in chars:
            raise self._error(f"expected {what}")
        self.pos += 1
        return found

    def _error(self, message: str, at: int | None = None) -> JsonStreamError:
        at = self.pos if at is None else at
        lines = self.buf.count("\n", 0, at)
        column = at - self.buf.rfind("\n", 0, at) if lines else self.column + at
        return JsonStreamError(f"{message} (line {self.line + lines}, column {column})")
