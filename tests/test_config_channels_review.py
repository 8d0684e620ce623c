"""Review of the config loader and the webhook/console channels, as a hostile user and a
careful operator: malformed files, secrets in errors and logs, hostile webhook receivers.

Real parts only: config files in tmp_path, raw-socket HTTP receivers on 127.0.0.1 (so a
receiver can misbehave below what ``http.server`` allows), the CLI as a real subprocess.
A test that proved a defect carries a ``# Was: DEFECT:`` line (each failed before its
fix); the others check a claim.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stalwart.channels import OutboundMessage, WebhookChannel
from stalwart.config import (
    ChannelSettings,
    Config,
    apply_agent_patch,
    load_config,
    parse_config,
)
from stalwart.errors import ChannelError, ConfigError

GUARD = 5.0  # real seconds: a bound on what should take milliseconds
URL_TOKEN = "T0REVIEW-path-token-31"
HOOK_SECRET = "xoxb-REVIEW-hook-secret-77"
SECRET_ENV = "STALWART_REVIEW_CFG_HOOK_SECRET"
MESSAGE = OutboundMessage(conversation="c1", text="hello", idempotency_key="k-1")

Logs = list[MutableMapping[str, Any]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- a raw HTTP receiver on 127.0.0.1 ----------------------------------------------------------


def _read_request(conn: socket.socket) -> bytes:
    """One request's head (its body read and dropped); b"" when the peer went away."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head


class RawReceiver:
    """Accepts connections and lets ``answer(receiver, conn, head)`` do anything with each
    request: a status a library would not send, headers and then nothing, a reset."""

    def __init__(self, answer: Callable[[RawReceiver, socket.socket, bytes], None]) -> None:
        self.answer = answer
        self.heads: list[bytes] = []
        self.connections = 0
        self.got = threading.Event()
        self.release = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.02)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{URL_TOKEN}?token={URL_TOKEN}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    head = _read_request(conn)
                    if not head:
                        return
                    self.heads.append(head)
                    self.got.set()
                    self.answer(self, conn, head)
            except OSError:
                return

    def close(self) -> None:
        self.release.set()
        self._stop.set()
        self._sock.close()


@pytest.fixture
def raw() -> Iterator[Callable[..., RawReceiver]]:
    made: list[RawReceiver] = []

    def make(answer: Callable[[RawReceiver, socket.socket, bytes], None]) -> RawReceiver:
        made.append(RawReceiver(answer))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _status(line: bytes, *headers: bytes) -> Callable[[RawReceiver, socket.socket, bytes], None]:
    def answer(_: RawReceiver, conn: socket.socket, __: bytes) -> None:
        conn.sendall(b"HTTP/1.1 " + line + b"\r\n" + b"".join(h + b"\r\n" for h in headers))
        conn.sendall(b"content-length: 0\r\n\r\n")

    return answer


def hook(url: str, **knobs: Any) -> WebhookChannel:
    entry = {"kind": "webhook", "url": url, "retry_base_ms": 1, "retry_cap_ms": 20, **knobs}
    config = parse_config({"channels": {"hook": entry}})
    return WebhookChannel("hook", config.channels["hook"])


async def send_once(channel: WebhookChannel) -> ChannelError:
    try:
        with pytest.raises(ChannelError) as failed:
            with anyio.fail_after(GUARD):
                await channel.send(MESSAGE)
    finally:
        await channel.aclose()
    return failed.value


def _stalwart(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STALWART_STORE", "STALWART_TRACEBACK")}
    return subprocess.run(
        [sys.executable, "-m", "stalwart", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- config: malformed files ---------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_a_deeply_nested_config_file_is_a_config_error(tmp_path: Path, suffix: str) -> None:
    # Was: DEFECT: read_document (config.py:652) lets the parsers' RecursionError escape raw; the
    # CLI says "internal error: RecursionError (a bug)". It should be a one-line ConfigError.
    depth = 5_000
    body = {
        ".json": '{"store": ' + "[" * depth,
        ".yaml": "store: " + "[" * depth,
        ".toml": "store = " + "[" * depth,
    }[suffix]
    path = tmp_path / f"deep{suffix}"
    path.write_text(body)
    failed: BaseException | None = None
    try:
        load_config(path)
    except (ConfigError, RecursionError) as error:
        failed = error
    assert isinstance(failed, ConfigError), f"a {suffix} file nested {depth} deep: {failed!r}"
    assert "\n" not in str(failed)


@pytest.mark.parametrize(
    ("suffix", "body"),
    [
        (
            ".yaml",
            "providers:\n  p: {kind: openai, base_url: 'http://llm.example'}\n"
            "agents:\n  triage: {provider: p, model: small}\n"
            "  triage: {provider: p, model: large}\n",
        ),
        (
            ".json",
            '{"providers": {"p": {"kind": "openai", "base_url": "http://llm.example"}},'
            ' "agents": {"triage": {"provider": "p", "model": "small"},'
            ' "triage": {"provider": "p", "model": "large"}}}',
        ),
    ],
)
def test_a_name_defined_twice_is_refused_in_every_format(
    tmp_path: Path, suffix: str, body: str
) -> None:
    # Was: DEFECT: read_document (config.py:648-650) lets YAML and JSON keep the last of two
    # same-named agents silently (TOML refuses it); it should be a ConfigError naming it.
    path = tmp_path / f"dup{suffix}"
    path.write_text(body)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "triage" in str(refused.value)


def test_a_toml_file_saved_with_a_byte_order_mark_loads_like_yaml_and_json(
    tmp_path: Path,
) -> None:
    # Was: DEFECT: read_document (config.py:651) decodes TOML as strict utf-8, so a file saved
    # with a BOM (PowerShell 5's -Encoding UTF8) is "Invalid statement (at line 1, column 1)"
    # while the same BOM in YAML or JSON loads; decode TOML with utf-8-sig.
    bom = b"\xef\xbb\xbf"
    (tmp_path / "c.json").write_bytes(bom + b'{"store": {"snapshot_every": 7}}')
    (tmp_path / "c.yaml").write_bytes(bom + b"store:\n  snapshot_every: 7\n")
    (tmp_path / "c.toml").write_bytes(bom + b"[store]\nsnapshot_every = 7\n")
    assert load_config(tmp_path / "c.json").store.snapshot_every == 7
    assert load_config(tmp_path / "c.yaml").store.snapshot_every == 7
    assert load_config(tmp_path / "c.toml").store.snapshot_every == 7


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("bad.toml", b'[store]\nlocation = "\xff"\n', ["bad.toml", "not valid"]),
        ("bad.yaml", b'store:\n  location: "\xff"\n', ["bad.yaml", "not valid"]),
        ("bad.json", b'{"store": {"location": "\xff"}}', ["bad.json", "not valid"]),
        (
            "nan.json",
            b'{"subagents": {"expected_fraction": NaN}}',
            ["subagents.expected_fraction", "found nan"],
        ),
        (
            "inf.yaml",
            b"context_engine:\n  context_threshold: .inf\n",
            ["context_engine.context_threshold", "found inf"],
        ),
        (
            "bool.yaml",
            b"channels:\n  ops: {kind: console, timeout_ms: yes}\n",
            ["channels.ops.timeout_ms", "found True"],
        ),
        (
            "huge.json",
            b'{"channels": {"ops": {"kind": "console", "max_attempts": 1e999}}}',
            ["channels.ops.max_attempts"],
        ),
        (
            "deep.toml",
            b"[context_engine.relevance]\nfirst_by_defalt = true\n",
            ["unknown key", "context_engine.relevance.first_by_defalt"],
        ),
    ],
)
def test_malformed_files_are_one_line_config_errors_naming_the_key(
    tmp_path: Path, name: str, content: bytes, words: list[str]
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    text = str(refused.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text


def test_a_directory_and_an_empty_file(tmp_path: Path) -> None:
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match=r"cannot read config .*dir\.toml: Is a directory"):
        load_config(tmp_path / "dir.toml")
    for name in ("empty.toml", "empty.yaml"):
        (tmp_path / name).write_text("")
        assert load_config(tmp_path / name) == Config()
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ConfigError, match=r"empty\.json is not valid"):
        load_config(tmp_path / "empty.json")


# -- config: values that parse but cannot work ------------------------------------------------


@pytest.mark.parametrize(
    "base_url",
    [
        "http://127.0.0.1:80800/v1",  # a typo in the port
        "api.llm.example/v1",  # no scheme
    ],
)
def test_a_provider_base_url_that_is_not_a_url_is_a_config_error(base_url: str) -> None:
    # Was: DEFECT: ProviderSettings.base_url (config.py:79) is never checked, unlike a webhook's
    # url: a bad port crashes to_record() (config.py:508) when the runtime starts, and a url
    # with no scheme fails every call. Config.__post_init__ should refuse it with the key.
    data = {
        "providers": {"main": {"kind": "openai", "base_url": base_url}},
        "agents": {"default": {"provider": "main", "model": "m1"}},
    }
    with pytest.raises(ConfigError) as refused:
        parse_config(data)
    assert refused.value.key == "providers.main.base_url"


def test_stalwart_worker_with_a_mistyped_provider_port_says_one_config_line(
    tmp_path: Path,
) -> None:
    # Was: DEFECT: the config loads, then Runtime's runtime_started -> Config.to_record ->
    # _without_secrets (config.py:508) raises ValueError("Port out of range"): the CLI prints
    # "internal error: ValueError (a bug ...)". It should say which key is wrong.
    config = tmp_path / "c.toml"
    config.write_text(
        '[providers.main]\nkind = "openai"\nbase_url = "http://127.0.0.1:80800/v1"\n'
        '[agents.default]\nprovider = "main"\nmodel = "m1"\n'
    )
    done = _stalwart(
        tmp_path, "--store", str(tmp_path / "store"), "worker", "--config", str(config)
    )
    err = done.stderr.strip()
    assert done.returncode == 1, err
    assert "internal error" not in err, err
    assert err.startswith("stalwart: error:"), err
    assert "providers.main.base_url" in err, err
    assert len(err.splitlines()) == 1, err


def test_an_empty_store_location_is_refused_not_the_working_directory(tmp_path: Path) -> None:
    # Was: DEFECT: StoreSettings.location (config.py:67) accepts "" (a blank templated value), and
    # `stalwart worker` then writes LMDB's data.mdb straight into the working directory.
    # An empty location should be a ConfigError naming store.location.
    work = tmp_path / "work"
    work.mkdir()
    config = tmp_path / "c.toml"
    config.write_text('[store]\nlocation = ""\n')
    done = _stalwart(work, "worker", "--config", str(config), "--for", "0")
    made = sorted(p.name for p in work.iterdir())
    assert made == [], f"the worker wrote {made} into its working directory"
    assert done.returncode == 1, done.stderr
    assert "store.location" in done.stderr, done.stderr


def test_a_config_error_from_the_cli_is_one_line_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "channels:\n  ops:\n    kind: webhook\n"
        f"    url: https://u:pw-REVIEW@hooks.example/{URL_TOKEN}\n    retries: 3\n"
    )
    done = _stalwart(tmp_path, "worker", "--config", str(config), "--for", "0")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"stalwart: error: {config}: unknown key 'channels.ops.retries'"
    ]
    assert not (tmp_path / ".stalwart").exists()  # nothing was opened or recorded


# -- config: secrets --------------------------------------------------------------------------


def test_a_header_line_pasted_into_secret_header_is_not_echoed() -> None:
    # Was: DEFECT: _check_channel (config.py:357) echoes an invalid secret_header with !r; the
    # natural mistake `secret_header = "Authorization: Bearer <token>"` prints the token
    # (as the _env keys' errors already avoid). Say what is wrong without the value.
    channel = {
        "kind": "webhook",
        "url": "https://hooks.example/in",
        "secret_header": f"X-Hook-Token: {HOOK_SECRET}",
        "secret_env": SECRET_ENV,
    }
    with pytest.raises(ConfigError) as refused:
        parse_config({"channels": {"ops": channel}})
    assert refused.value.key == "channels.ops.secret_header"
    assert HOOK_SECRET not in str(refused.value), str(refused.value)


# token-shaped strings built at run time, so no scanner takes this file for a leak
PASTED_KEYS = [
    "sk_" + "live_" + "4eC39HqLyjWDarjtT1zdp7dc",
    "gh" + "p_" + "16C7e42F292c6912E7710c838347Ae178B4a",
    "github_" + "pat_" + "11ABCDEFG0abcdefghijkl_mnopqrstuvwxyz0123456789",
    "AK" + "IA" + "IOSFODNN7EXAMPLE",
    "AI" + "za" + "SyDdI0hCZtE6vySjMm_WEfqq7JPUXmfXvhk",
    "Q3vT9kLm2Xp7Rb8Nw4Yz6Hc1Jd5Fg0Aa",  # a bare random token, 32 characters
]


@pytest.mark.parametrize("pasted", PASTED_KEYS)
def test_a_key_pasted_where_its_variables_name_belongs_is_refused_without_echoing_it(
    pasted: str,
) -> None:
    # Was: DEFECT: api_key_env and secret_env took any identifier-shaped string, so a key
    # pasted there was recorded in runtime:started's config, and the "not set" warning
    # (provider.api_key_missing env=...) logged it.
    provider = {"kind": "openai", "base_url": "https://api.example/v1", "api_key_env": pasted}
    with pytest.raises(ConfigError) as refused:
        parse_config({"providers": {"main": provider}})
    assert refused.value.key == "providers.main.api_key_env"
    assert pasted not in str(refused.value), str(refused.value)
    channel = {
        "kind": "webhook",
        "url": "https://hooks.example/in",
        "secret_header": "X-Hook-Token",
        "secret_env": pasted,
    }
    with pytest.raises(ConfigError) as refused:
        parse_config({"channels": {"ops": channel}})
    assert refused.value.key == "channels.ops.secret_env"
    assert pasted not in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "name",
    [
        "OPENAI_API_KEY",
        "ANTHROPIC_API_KEY",
        "openai_key",
        "AZURE_OPENAI_API_KEY_EASTUS2",
        "MyCompanyOpenAIKeyProd2024",
        "STALWART_WEBHOOK_SECRET_FOR_THE_SUPPORT_CHANNEL_2",
        "GH_TOKEN",
        "SK_LIVE_KEY",
    ],
)
def test_an_ordinary_variables_name_is_taken(name: str) -> None:
    provider = {"kind": "openai", "base_url": "https://api.example/v1", "api_key_env": name}
    config = parse_config({"providers": {"main": provider}})
    assert config.providers["main"].api_key_env == name


def test_an_agent_patch_cannot_send_the_providers_key_to_another_host() -> None:
    # Was: DEFECT: apply_agent_patch (config.py:516-525) guards only context_engine.version; an
    # agent's patch may repoint providers.*.base_url (its API key then goes to that host),
    # store.location or its own `subagents` tool. Only `agents.<self>` tuning should pass.
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": "https://llm.example/v1"}},
            "agents": {"default": {"provider": "main", "model": "m1"}},
        }
    )
    patch = {"providers": {"main": {"base_url": "https://collector.evil.example/v1"}}}
    with pytest.raises(ConfigError) as refused:
        apply_agent_patch(config, patch)
    assert str(refused.value.key).startswith("providers"), str(refused.value)


# -- webhook against hostile receivers -------------------------------------------------------


@pytest.mark.anyio
async def test_closing_a_webhook_ends_its_attempt_in_flight_as_closed(
    raw: Callable[..., RawReceiver],
) -> None:
    # Was: DEFECT: aclose() closes the pool under the attempt, which fails as a retryable
    # `transport` ReadError (_webhook.py:131 maps only RuntimeError to closed); docs say
    # it "fails at once as `closed`". send() should check self._closed before _error().
    def hang(receiver: RawReceiver, _: socket.socket, __: bytes) -> None:
        receiver.release.wait(GUARD)

    receiver = raw(hang)
    channel = hook(receiver.url, timeout_ms=60_000, max_attempts=1)
    failed: list[BaseException] = []

    async def sending() -> None:
        try:
            await channel.send(MESSAGE)
        except BaseException as exc:
            failed.append(exc)

    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sending)
            assert await anyio.to_thread.run_sync(receiver.got.wait, GUARD)
            await channel.aclose()
    assert len(failed) == 1, failed
    assert isinstance(failed[0], ChannelError), failed
    assert (failed[0].kind, failed[0].retryable) == ("closed", False), str(failed[0])


@pytest.mark.anyio
async def test_a_status_outside_the_5xx_range_is_a_rejection(
    raw: Callable[..., RawReceiver],
) -> None:
    # Was: DEFECT: _status_failure (_webhook.py:213) treats any status >= 500 (600, 999) as a
    # retryable server_error; channels.md says only 5xx is, any other status is `rejected`.
    receiver = raw(_status(b"999 Weird"))
    error = await send_once(hook(receiver.url, max_attempts=3))
    assert (error.kind, error.retryable, error.attempts) == ("rejected", False, 1), str(error)


@pytest.mark.anyio
async def test_a_receiver_echoing_the_secret_in_its_reason_phrase_stays_out_of_the_log(
    raw: Callable[..., RawReceiver],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Was: DEFECT: httpx logs `HTTP Request: POST <url> "HTTP/1.1 401 <reason phrase>"` at INFO;
    # _HideUrlSecrets (_logs.py:123) rewrites the url only, so a receiver that echoes the
    # secret header in its reason phrase puts it in the host's log. Drop the reason there.
    monkeypatch.setenv(SECRET_ENV, HOOK_SECRET)

    def echo(_: RawReceiver, conn: socket.socket, head: bytes) -> None:
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"x-hook-token:"):
                token = line.partition(b":")[2].strip()
                conn.sendall(b"HTTP/1.1 401 bad token " + token + b"\r\ncontent-length: 0\r\n\r\n")

    receiver = raw(echo)
    caplog.set_level(logging.INFO, logger="httpx")
    error = await send_once(hook(receiver.url, secret_header="X-Hook-Token", secret_env=SECRET_ENV))
    assert error.kind == "rejected"
    assert HOOK_SECRET.encode() in receiver.heads[0]  # it was sent, in its header
    assert any("HTTP Request" in r.getMessage() for r in caplog.records)  # httpx did log
    assert HOOK_SECRET not in caplog.text, caplog.text


@pytest.mark.anyio
async def test_a_receiver_that_hangs_after_its_headers_does_not_hold_the_send(
    raw: Callable[..., RawReceiver],
) -> None:
    """channels.md: "Any 2xx accepts the message. The response body is not read." A
    receiver that promises a gigabyte and sends three bytes must not hold the send until
    the attempt's limit (60 s here)."""

    def promise(receiver: RawReceiver, conn: socket.socket, _: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000\r\n\r\nabc")
        receiver.release.wait(GUARD)

    receiver = raw(promise)
    channel = hook(receiver.url, timeout_ms=60_000, max_attempts=1)
    try:
        with anyio.fail_after(GUARD):
            delivery = await channel.send(MESSAGE)
    finally:
        await channel.aclose()
    assert (delivery.status, delivery.attempts) == (200, 1)


@pytest.mark.anyio
async def test_a_redirect_to_another_host_is_a_rejection_never_followed(
    raw: Callable[..., RawReceiver],
) -> None:
    """channels.md: "Redirects are not followed: a 3xx is a rejection." The host it points
    to never hears from us, and the error does not repeat the Location."""
    elsewhere = raw(_status(b"200 OK"))
    location = f"http://127.0.0.1:{elsewhere.port}/stolen/{URL_TOKEN}".encode()
    receiver = raw(_status(b"307 Temporary Redirect", b"location: " + location))
    error = await send_once(hook(receiver.url, max_attempts=3))
    assert (error.kind, error.retryable, error.status, error.attempts) == (
        "rejected",
        False,
        307,
        1,
    )
    assert elsewhere.connections == 0
    assert URL_TOKEN not in str(error)
    assert str(elsewhere.port) not in str(error)


@pytest.mark.anyio
async def test_a_reset_connection_is_retried_then_reported_without_content(
    raw: Callable[..., RawReceiver], logs: Logs
) -> None:
    """A receiver that resets every connection: each attempt is a retryable ``transport``
    failure, the attempts run out, and neither the error nor the retry log lines hold the
    url's token or the message's text."""

    def reset(_: RawReceiver, conn: socket.socket, __: bytes) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()

    receiver = raw(reset)
    error = await send_once(hook(receiver.url, max_attempts=3))
    assert (error.kind, error.retryable, error.attempts) == ("transport", True, 3)
    assert len(receiver.heads) == 3
    retries = [entry for entry in logs if entry["event"] == "channel.retry_scheduled"]
    assert [entry["attempt"] for entry in retries] == [1, 2]
    shown = str(error) + repr(logs)
    assert URL_TOKEN not in shown
    assert "hello" not in shown


@pytest.mark.anyio
async def test_untrusted_response_text_reaches_neither_the_error_nor_the_channels_log(
    raw: Callable[..., RawReceiver], logs: Logs
) -> None:
    """A 503 whose reason phrase, headers and body carry text (and a terminal escape): the
    ChannelError says ``HTTP 503`` and the retry lines say the status, nothing else."""
    body = b"\x1b[2J\x1b]52;c;Zm9v\x07 receiver-says-REVIEW"

    def noisy(receiver: RawReceiver, conn: socket.socket, head: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 503 receiver-says-REVIEW\r\nx-detail: receiver-says-REVIEW\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )

    receiver = raw(noisy)
    error = await send_once(hook(receiver.url, max_attempts=2))
    assert (error.kind, error.status, error.attempts) == ("server_error", 503, 2)
    shown = str(error) + repr(logs)
    assert "receiver-says" not in shown, shown
    assert "\x1b" not in shown, shown


def test_a_webhook_settings_repr_and_record_hide_the_token_even_with_user_info() -> None:
    """The repr and ``to_record()`` of a webhook with a password, a path token and a query
    token show only scheme, host and port."""
    url = f"https://bot:pw-REVIEW@hooks.example:8443/services/{URL_TOKEN}?sig=sig-REVIEW"
    config = parse_config({"channels": {"ops": {"kind": "webhook", "url": url}}})
    shown = repr(config) + repr(config.channels["ops"]) + str(config.to_record())
    for secret in ("pw-REVIEW", URL_TOKEN, "sig-REVIEW"):
        assert secret not in shown, secret
    assert config.to_record()["channels"]["ops"]["url"] == "https://hooks.example:8443/..."
    assert isinstance(config.channels["ops"], ChannelSettings)
