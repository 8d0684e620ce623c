"""Configuration: defaults from the seeds, clear errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.config import Config, load_config, parse_config
from stalwart.errors import ConfigError


def test_defaults() -> None:
    config = parse_config({})
    assert config == Config()
    assert config.store.snapshot_every == 500
    assert config.store.location == ".stalwart"


def test_toml_and_yaml_load_the_same(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[store]\nsnapshot_every = 50\nlocation = '/var/lib/stalwart'\n")
    yaml = tmp_path / "c.yaml"
    yaml.write_text("store:\n  snapshot_every: 50\n  location: /var/lib/stalwart\n")
    assert load_config(toml) == load_config(yaml)
    assert load_config(toml).store.snapshot_every == 50


def test_empty_yaml_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("")
    assert load_config(path) == Config()


_AGENT = {"providers": {"p": {"kind": "openai", "base_url": "http://127.0.0.1:9"}}}
_MODEL = {"provider": "p", "model": "m"}


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        ({"store": {"snapshot_evry": 5}}, "store.snapshot_evry", ["unknown key"]),
        ({"stor": {}}, "stor", ["unknown key"]),
        ({"store": {"snapshot_every": -1}}, "store.snapshot_every", [">= 0", "found -1"]),
        ({"store": {"tail_poll_ms": "fast"}}, "store.tail_poll_ms", ["int", "found 'fast'"]),
        ({"store": {"tail_poll_ms": 5000}}, "store.tail_poll_ms", ["<= 1000", "found 5000"]),
        ({"store": 3}, "store", ["object", "found 3"]),
        (
            {"activations": {"lease_ttl_ms": 10_000, "renew_every_ms": 10_000}},
            "activations.lease_ttl_ms",
            ["> activations.renew_every_ms (10000)", "found 10000"],
        ),
        (
            {"activations": {"backoff_base_ms": 9_000, "backoff_cap_ms": 8_000}},
            "activations.backoff_cap_ms",
            [">= activations.backoff_base_ms (9000)", "found 8000"],
        ),
        # Was: DEFECT: an agent's retry_base_ms above its cap was silently clamped
        (
            {**_AGENT, "agents": {"default": {**_MODEL, "retry_base_ms": 9_000}}},
            "agents.default.retry_cap_ms",
            [">= agents.default.retry_base_ms (9000)", "found 8000"],
        ),
        # Was: DEFECT: a max_tokens that leaves the conversation no room (budget 1: every
        # request over the window) was accepted
        (
            {**_AGENT, "agents": {"default": {**_MODEL, "context_window": 1_024}}},
            "agents.default.max_tokens",
            ["at least 256 of agents.default.context_window (1024)", "found 1024"],
        ),
        # Was: DEFECT: an empty model name was accepted (an empty fallback model was not)
        (
            {**_AGENT, "agents": {"default": {**_MODEL, "model": " "}}},
            "agents.default.model",
            ["must name a model"],
        ),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(
    data: object, key: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="app.toml")
    assert info.value.key == key
    message = str(info.value)
    assert message.startswith("app.toml: ")
    assert key in message
    for word in words:
        assert word in message


def test_unparseable_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[store\n")
    with pytest.raises(ConfigError, match="not valid TOML/YAML"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")


def test_a_json_config_loads_like_toml(tmp_path: Path) -> None:
    path = tmp_path / "stalwart.json"
    path.write_text('{"providers": {"p": {"kind": "openai", "base_url": "http://x/v1"}}}')
    assert load_config(path).providers["p"].base_url == "http://x/v1"
