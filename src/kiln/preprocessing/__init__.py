"""Preprocessing recipes: what a dataset records about its inputs (normalisation, tokenizer,
labels), typed, one per input kind. Every checkpoint carries its recipe as plain data, and
inference and serving rebuild the exact training transform from it. A leaf: it imports no dataset
module, so the server never loads pandas or scikit-learn.

The recipes are loaded on first use (PEP 562), so what needs only `InputError` -- `infer.py
--help`, a config error -- does not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import Any

from kiln.preprocessing.errors import InputError, describe_shape

_HOMES = {
    "ImagePreprocessor": "kiln.preprocessing.image",
    "ImageRecipe": "kiln.preprocessing.image",
    "normalise": "kiln.preprocessing.image",
    "ImageListPreprocessor": "kiln.preprocessing.image_list",
    "ImageListRecipe": "kiln.preprocessing.image_list",
    "TokenPreprocessor": "kiln.preprocessing.text",
    "TokenRecipe": "kiln.preprocessing.text",
}


def _unions() -> dict[str, Any]:
    image, image_list, text = (
        importlib.import_module(f"kiln.preprocessing.{name}")
        for name in ("image", "image_list", "text")
    )
    recipes = (image.ImageRecipe, text.TokenRecipe, image_list.ImageListRecipe)
    return {
        "Recipe": image.ImageRecipe | text.TokenRecipe | image_list.ImageListRecipe,
        "Preprocessor": (
            image.ImagePreprocessor | text.TokenPreprocessor | image_list.ImageListPreprocessor
        ),
        "RECIPES": {r.kind: r for r in recipes},
    }


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name in ("Recipe", "Preprocessor", "RECIPES"):
        value = _unions()[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def recipe_from_dict(data: dict[str, Any]):
    """The recipe a checkpoint (or an export's sidecar JSON) stored with `to_dict`."""
    recipes = __getattr__("RECIPES")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != "kind"}
    kind = data.get("kind")
    if kind not in recipes:
        raise ValueError(f"unknown preprocessing kind {kind!r}; known: {', '.join(recipes)}")
    return recipes[kind](**fields)


__all__ = [
    "RECIPES",
    "ImageListPreprocessor",
    "ImageListRecipe",
    "ImagePreprocessor",
    "ImageRecipe",
    "InputError",
    "Preprocessor",
    "Recipe",
    "TokenPreprocessor",
    "TokenRecipe",
    "describe_shape",
    "normalise",
    "recipe_from_dict",
]
