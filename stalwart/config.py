"""Typed configuration, loaded from TOML or YAML; defaults come from the product seeds.

Unknown keys, wrong types and out-of-range values are a :class:`ConfigError` that names
the key, the value found and what is allowed.
"""

from __future__ import annotations

import os
import re
import tomllib
from typing import Annotated, Any

import msgspec
import yaml

from .errors import ConfigError

__all__ = ["Config", "StoreSettings", "load_config", "parse_config"]


class StoreSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the event log lives and how it is kept."""

    location: str = ".stalwart"
    snapshot_every: Annotated[int, msgspec.Meta(ge=0)] = 500
    tail_poll_ms: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 10


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole runtime configuration; recorded in ``runtime:started``."""

    store: StoreSettings = msgspec.field(default_factory=StoreSettings)


_PATH = re.compile(r"at `\$((?:\.[A-Za-z_][\w]*|\[\d+\])*)`")


def parse_config(data: Any, *, source: str = "config") -> Config:
    """A Config from already-parsed TOML/YAML data."""
    if data is None:
        data = {}
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        key = match.group(1).lstrip(".") if match else None
        unknown = re.search(r"unknown field `([^`]+)`", message)
        if unknown:
            key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
            raise ConfigError(f"{source}: unknown key {key!r}", key=key) from None
        expected = message.split(" - at ", maxsplit=1)[0]
        found = _lookup(data, key) if key else data
        where = f"key {key!r}: " if key else ""
        raise ConfigError(f"{source}: {where}{expected}, found {found!r}", key=key) from None


def _lookup(data: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict):
            return data
        data = data.get(part)
    return data


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) config file."""
    text_path = os.fspath(path)
    try:
        with open(text_path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config {text_path}: {exc.strerror}") from None
    try:
        if text_path.endswith((".yaml", ".yml")):
            data = yaml.safe_load(raw)
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{text_path} is not valid TOML/YAML: {first}") from None
    return parse_config(data, source=text_path)
