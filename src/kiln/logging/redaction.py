"""Keep credentials out of logged configs: a config is copied to W&B, TensorBoard and run dirs
that get shared, so a key that slipped into `extra` or an interpolated env var must not travel."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REDACTED = "[redacted]"
# Config keys whose values are secrets whatever they hold: whole words between "_", "-" or "."
# separators, so hf_token and api_key match but tokenizer and max_tokens_per_batch do not.
_SECRET_KEY_PATTERN = re.compile(
    r"(?:^|[_.-])(?:api[_-]?key|token|secret|password|passwd|credentials?)(?:$|[_.-])", re.I
)
# Environment variables whose values must never appear anywhere in a logged config.
SECRET_ENV_VARS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
_MIN_SECRET_LENGTH = 8  # shorter values would redact ordinary words like "true"


def secret_values_from_env(names: Iterable[str] = SECRET_ENV_VARS) -> list[str]:
    values = (os.environ.get(name, "") for name in names)
    return [value for value in values if len(value) >= _MIN_SECRET_LENGTH]


def redact(config: Any, secrets: Iterable[str] | None = None) -> Any:
    """A plain copy of `config` (nested mappings and sequences, an OmegaConf DictConfig too) with
    secret-named keys and any occurrence of a secret value replaced by "[redacted]".
    `secrets` defaults to the values of SECRET_ENV_VARS that are set."""
    secret_list = list(secret_values_from_env() if secrets is None else secrets)
    return _redact(config, secret_list)


def _redact(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, Mapping):
        return {
            key: REDACTED
            if _SECRET_KEY_PATTERN.search(str(key)) and item is not None
            else _redact(item, secrets)
            for key, item in value.items()
        }
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return [_redact(item, secrets) for item in value]
    return value
