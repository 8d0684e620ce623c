"""A url with whitespace in a config (a space typed into a host, a trailing space or a
newline pasted with it) is refused when the config loads, naming the key, never the url.
Before, httpx sent it percent-encoded (``exa%20mple.com``, ``/v1%20``): a host no resolver
knows or a path the server does not have, so every model call or delivery failed at run
time instead."""

from __future__ import annotations

import pytest

from tests._support_s35 import config_refused, provider_at, webhook_at

URLS = [
    "http://llm.exa mple/v1",  # a space typed into the host
    "http://llm.example/v1 ",  # a trailing space pasted with it
    "https://llm.example/v 1",
    "http://llm.example/\u00a0v1",  # a no-break space from a web page
]


# Was: DEFECT: a provider base_url with whitespace loaded and failed every call at run time
@pytest.mark.parametrize("url", URLS)
def test_a_provider_base_url_with_whitespace_is_a_config_error(url: str) -> None:
    error = config_refused(provider_at(url), match="whitespace")
    assert error.key == "providers.main.base_url"
    assert "exa" not in str(error)  # the url itself is not echoed


# Was: DEFECT: a webhook url with whitespace loaded and every delivery failed at run time
@pytest.mark.parametrize("url", URLS)
def test_a_webhook_url_with_whitespace_is_a_config_error(url: str) -> None:
    assert config_refused(webhook_at(url), match="whitespace").key == "channels.hook.url"
