"""`clean_text`: the one cleaning step every text goes through before the tokenizer, in training,
in `infer.py` and in the server alike. Its settings (`TextCleaning`) travel in every checkpoint
inside the TokenRecipe, so inference can never clean differently from training.

Order matters: tags are stripped before entities are unescaped (so `&lt;b&gt;` stays the text
`<b>`), Unicode is normalised before lowercasing, and whitespace is collapsed last. Standard
library only: the server imports this."""

from __future__ import annotations

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
# (or /letter) right after "<", so "a < b" and "x<3" survive.
_INVISIBLE_HTML = re.compile(r"<(script|style)\b[^>]*>.*?</\1\s*>|<!--.*?-->", re.S | re.I)
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
        text = _TAG.sub(" ", _INVISIBLE_HTML.sub(" ", text))
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


def clean_texts(texts: list[str], cleaning: TextCleaning) -> list[str]:
    return [clean_text(text, cleaning) for text in texts]
