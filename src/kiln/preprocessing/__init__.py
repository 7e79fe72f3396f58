"""Preprocessing recipes: what a dataset records about its inputs (normalisation, tokenizer,
labels), typed, one per input kind. Every checkpoint carries its recipe as plain data, and
inference and serving rebuild the exact training transform from it. A leaf: it imports no dataset
module, so the server never loads pandas or scikit-learn."""

from __future__ import annotations

from typing import Any

from kiln.preprocessing.errors import InputError, describe_shape
from kiln.preprocessing.image import ImagePreprocessor, ImageRecipe, normalise
from kiln.preprocessing.image_list import ImageListPreprocessor, ImageListRecipe
from kiln.preprocessing.text import TokenPreprocessor, TokenRecipe

Recipe = ImageRecipe | TokenRecipe | ImageListRecipe
Preprocessor = ImagePreprocessor | TokenPreprocessor | ImageListPreprocessor
RECIPES: dict[str, type] = {r.kind: r for r in (ImageRecipe, TokenRecipe, ImageListRecipe)}


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """The recipe a checkpoint (or an export's sidecar JSON) stored with `to_dict`."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != "kind"}
    kind = data.get("kind")
    if kind not in RECIPES:
        raise ValueError(f"unknown preprocessing kind {kind!r}; known: {', '.join(RECIPES)}")
    return RECIPES[kind](**fields)


__all__ = [
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
