"""`clean_text`: the one cleaning step every text goes through before the tokenizer, in training,
in `infer.py` and in the server alike. Its settings (`TextCleaning`) travel in every checkpoint
inside the TokenRecipe, so inference can never clean differently from training.

Order matters: tags are stripped before entities are unescaped (so `&lt;b&gt;` stays the text
`<b>`), Unicode is normalised before lowercasing, and whitespace is collapsed last. Standard
library only: the server imports this."""

from __future__ import annotations

import functools
import html
import re
import unicodedata
from dataclasses import asdict, dataclass
from typing import Any

UNICODE_FORMS = ("NFC", "NFKC", "none")
# Between the two texts of a pair where one string holds both (the spool, the cleaned rows):
# the ASCII unit separator, which cleaning's whitespace step drops from any text.
PAIR_SEP = "\x1f"

# Script and style bodies are code, not text; comments are markup. A tag starts with a letter
# (or /letter) right after "<", so "a < b" and "x<3" survive. The tag pattern cannot backtrack
# past the next "<" or ">", so it is linear; the invisible parts are found by drop_invisible.
_CLOSER = {kind: re.compile(rf"</{kind}\s*>", re.I) for kind in ("script", "style")}
_TAG = re.compile(r"</?[A-Za-z][^<>]*>")


@dataclass(frozen=True)
class TextCleaning:
    strip_html: bool = True  # drop tags (keeping their text), scripts, styles and comments
    unescape_entities: bool = True  # &amp; -> &, &lt; -> <, &#233; -> é
    unicode_form: str = "NFKC"  # NFC | NFKC (also folds ligatures, full-width forms) | none
    lowercase: bool = True
    normalize_whitespace: bool = True  # runs of whitespace -> one space; drop control chars

    def __post_init__(self):
        if self.unicode_form not in UNICODE_FORMS:  # an invariant: the config checked it
            raise ValueError(
                f"unicode_form must be one of {UNICODE_FORMS}, got {self.unicode_form}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NO_CLEANING = TextCleaning(
    strip_html=False,
    unescape_entities=False,
    unicode_form="none",
    lowercase=False,
    normalize_whitespace=False,
)


def clean_text(text: str, cleaning: TextCleaning) -> str:
    """One text, cleaned as `cleaning` says. Cheap checks skip the steps a text does not need
    (most texts have no '<' or '&' and are ASCII), which keeps this off the data path's
    critical path."""
    if cleaning.strip_html and "<" in text:
        text = _TAG.sub(" ", drop_invisible(text))
    if cleaning.unescape_entities and "&" in text:
        text = html.unescape(text)
    if cleaning.unicode_form != "none" and not text.isascii():
        text = unicodedata.normalize(cleaning.unicode_form, text)
    if cleaning.lowercase:
        text = text.lower()
    if cleaning.normalize_whitespace:
        text = " ".join(text.split())
        # Control and format characters (NUL, zero-width space...) go; line breaks and tabs are
        # gone already, so the character-by-character pass runs only for texts that have them.
        if not text.isprintable():
            text = " ".join("".join(ch for ch in text if ch.isprintable()).split())
    return text


def drop_invisible(text: str) -> str:
    r"""Each script or style element (`<script ...>` to its `</script>`) and each comment (`<!--`
    to `-->`) replaced by a space: what re.sub of `<(script|style)\b[^>]*>.*?</\1\s*>|<!--.*?-->`
    (DOTALL, IGNORECASE) gives, in linear time. That expression is quadratic on openers left
    unclosed (each one searches to the end of the text: 64 KB of `<!--` took 12 s): here a
    closer searched for and not found is not searched for again, as no later opener of its kind
    can find one either, and such openers are no longer looked for."""
    pieces, kept_from, at = [], 0, 0
    unclosed: frozenset[str] = frozenset()  # kinds with no closer after `at` ("tag": no ">")
    while (opener := _opener(unclosed)) is not None and (found := opener.search(text, at)):
        kind = "comment" if found.group() == "<!--" else found.group()[1:].lower()
        at = found.end()
        if kind == "comment":
            close = text.find("-->", at)
            end = close + 3 if close >= 0 else -1
        elif (bracket := text.find(">", at)) < 0:
            unclosed |= {"tag"}
            continue
        else:
            closer = _CLOSER[kind].search(text, bracket + 1)
            end = closer.end() if closer is not None else -1
        if end < 0:
            unclosed |= {kind}
            continue
        pieces += (text[kept_from : found.start()], " ")
        kept_from = at = end
    if not pieces:
        return text
    pieces.append(text[kept_from:])
    return "".join(pieces)


@functools.cache
def _opener(unclosed: frozenset[str]) -> re.Pattern | None:
    """The openers still worth finding: those whose kind may yet be closed."""
    elements = [k for k in ("script", "style") if k not in unclosed and "tag" not in unclosed]
    either = [rf"<({'|'.join(elements)})\b"] if elements else []
    either += ["<!--"] if "comment" not in unclosed else []
    return re.compile("|".join(either), re.I) if either else None


def clean_texts(texts: list[str], cleaning: TextCleaning) -> list[str]:
    return [clean_text(text, cleaning) for text in texts]
