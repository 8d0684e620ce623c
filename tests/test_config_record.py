"""The config recorded in ``runtime:started`` keeps what replay needs and drops URL secrets."""

from __future__ import annotations

import msgspec

from stalwart.config import parse_config

TOKEN = "T0KEN-in-the-path-9f8e7d"
QUERY = "key=sk-query-secret-123"


def _config() -> dict[str, object]:
    return {
        "providers": {
            "gw": {"kind": "openai", "base_url": f"https://user:pw@gw.example:8443/v1?{QUERY}"}
        },
        "agents": {"default": {"provider": "gw", "model": "m", "prompt_timeout_ms": 1234}},
        "channels": {
            "chat": {"kind": "webhook", "url": f"https://hooks.example/services/{TOKEN}?{QUERY}"}
        },
    }


def test_recorded_urls_lose_user_info_queries_and_webhook_paths() -> None:
    record = parse_config(_config()).to_record()
    text = msgspec.json.encode(record).decode()
    for secret in (TOKEN, "sk-query-secret", "user:pw"):
        assert secret not in text
    assert record["providers"]["gw"]["base_url"] == "https://gw.example:8443/v1"
    assert record["channels"]["chat"]["url"] == "https://hooks.example/..."


def test_everything_else_is_recorded_as_configured() -> None:
    config = parse_config(_config())
    record = config.to_record()
    assert record["agents"]["default"]["prompt_timeout_ms"] == 1234
    assert record["store"] == msgspec.to_builtins(config.store)
    assert record.keys() == msgspec.to_builtins(config).keys()
