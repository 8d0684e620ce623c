"""Typed configuration, loaded from TOML or YAML; defaults come from the product seeds.

Unknown keys, wrong types and out-of-range values are a :class:`ConfigError` that names
the key, the value found and what is allowed.
"""

from __future__ import annotations

import os
import re
import tomllib
from typing import Annotated, Any, Literal, NoReturn

import msgspec
import msgspec.inspect
import yaml

from .errors import ConfigError

__all__ = [
    "AgentSettings",
    "Config",
    "ProviderSettings",
    "StoreSettings",
    "load_config",
    "parse_config",
]

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class StoreSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the event log lives and how it is kept."""

    location: str = ".stalwart"
    snapshot_every: Annotated[int, msgspec.Meta(ge=0)] = 500
    tail_poll_ms: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 10


class ProviderSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One LLM endpoint. ``kind`` picks the wire protocol; the key comes from an env var."""

    kind: Literal["openai", "anthropic"]
    base_url: str
    api_key_env: str | None = None
    connect_timeout_ms: Positive = 10_000
    max_in_flight: Positive = 64
    breaker_failure_threshold: Positive = 5
    breaker_reset_timeout_ms: Positive = 60_000


class AgentSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an agent calls its model: the seed's prompt-timeout knobs and the fallback chain.

    Models in ``fallback_models`` and ``vision_fallback_models`` are ``provider:model``.
    """

    provider: str
    model: str
    fallback_models: tuple[str, ...] = ()
    vision_fallback_models: tuple[str, ...] = ()
    prompt_timeout_ms: Positive = 180_000
    retry_prompt_timeout_ms: Positive = 60_000
    stall_ceiling_multiplier: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 10
    max_retries: NonNegative = 2
    retry_base_ms: Positive = 500
    retry_cap_ms: Positive = 8_000
    rate_limit_same_model_max_retry_after_ms: NonNegative = 20_000
    activity_interval_ms: Positive = 1_000
    max_tokens: Positive = 1024
    stream: bool = True


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole runtime configuration; recorded in ``runtime:started``."""

    store: StoreSettings = msgspec.field(default_factory=StoreSettings)
    providers: dict[str, ProviderSettings] = msgspec.field(default_factory=dict)
    agents: dict[str, AgentSettings] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, agent in self.agents.items():
            where = f"agents.{name}"
            if agent.provider not in self.providers:
                raise ConfigError(
                    f"key '{where}.provider': no provider named {agent.provider!r} "
                    f"(configured: {sorted(self.providers) or 'none'})",
                    key=f"{where}.provider",
                )
            for key in ("fallback_models", "vision_fallback_models"):
                for entry in getattr(agent, key):
                    provider, sep, model = entry.partition(":")
                    if not sep or not model or provider not in self.providers:
                        raise ConfigError(
                            f"key '{where}.{key}': {entry!r} must be 'provider:model' with a "
                            f"configured provider (configured: {sorted(self.providers) or 'none'})",
                            key=f"{where}.{key}",
                        )

    def agent(self, name: str = "default") -> AgentSettings:
        """The named agent's settings, or ConfigError listing the configured ones."""
        try:
            return self.agents[name]
        except KeyError:
            raise ConfigError(
                f"no agent named {name!r} (configured: {sorted(self.agents) or 'none'})",
                key=f"agents.{name}",
            ) from None


_PATH = re.compile(r"at `\$((?:\.[A-Za-z_][\w]*|\[\d+\])*)`")


def parse_config(data: Any, *, source: str = "config") -> Config:
    """A Config from already-parsed TOML/YAML data."""
    if data is None:
        data = {}
    if isinstance(data, dict):
        # msgspec hides dict keys in its paths ("$.providers[...]"): check entries one by
        # one so that an error names the provider or agent it is about
        for section, kind in (("providers", ProviderSettings), ("agents", AgentSettings)):
            entries = data.get(section)
            if isinstance(entries, dict):
                for name, entry in entries.items():
                    try:
                        msgspec.convert(entry, kind)
                    except msgspec.ValidationError as exc:
                        _fail(exc, entry, f"{section}.{name}", source, kind)
    try:
        return msgspec.convert(data, Config)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}", key=exc.key) from None
    except msgspec.ValidationError as exc:
        _fail(exc, data, "", source, Config)


def _fail(
    exc: msgspec.ValidationError, data: Any, prefix: str, source: str, root: type
) -> NoReturn:
    message = str(exc)
    match = _PATH.search(message)
    inner = match.group(1).lstrip(".") if match else ""
    key = ".".join(part for part in (prefix, inner) if part) or None
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        raise ConfigError(f"{source}: unknown key {key!r}", key=key) from None
    expected = message.split(" - at ", maxsplit=1)[0]
    allowed = _allowed(root, inner)
    if allowed:
        expected = f"{expected}; allowed: {', '.join(repr(v) for v in allowed)}"
    found = _lookup(data, inner) if inner else data
    where = f"key {key!r}: " if key else ""
    raise ConfigError(f"{source}: {where}{expected}, found {found!r}", key=key) from None


def _allowed(root: type, path: str) -> tuple[Any, ...]:
    """The values a Literal field allows, to say them in the error."""
    info: Any = msgspec.inspect.type_info(root)
    for part in path.split(".") if path else ():
        fields = {f.name: f.type for f in getattr(info, "fields", ())}
        info = fields.get(part)
        if info is None:
            return ()
    return tuple(getattr(info, "values", ()))


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
