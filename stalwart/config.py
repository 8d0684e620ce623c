"""Typed configuration, loaded from TOML or YAML; defaults come from the product seeds.

Unknown keys, wrong types and out-of-range values are a :class:`ConfigError` that names
the key, the value found and what is allowed.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import unicodedata
from typing import Annotated, Any, Literal, NoReturn
from urllib.parse import urlsplit

import httpx
import msgspec
import msgspec.inspect
import yaml

from .errors import ConfigError

__all__ = [
    "MIN_CONTEXT_WINDOW",
    "MIN_PROMPT_TOKENS",
    "ActivationSettings",
    "AgentSettings",
    "ChannelSettings",
    "ClassTimeouts",
    "Config",
    "ContextEngineSettings",
    "DeadLetterSettings",
    "HealthSettings",
    "ObservationTier",
    "PipelineConfig",
    "ProviderSettings",
    "RelevanceSettings",
    "StoreSettings",
    "SubagentSettings",
    "SummarizerBreakerSettings",
    "SummarizerSpendSettings",
    "SupervisionSettings",
    "apply_agent_patch",
    "load_config",
    "looks_like_secret",
    "parse_config",
    "parse_pipeline",
    "read_document",
]

#: The largest whole-number knob: what any JSON reader takes exactly (and far beyond any
#: sensible count or duration); larger could not even be recorded in ``runtime:started``
MAX_KNOB = 2**53 - 1
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_KNOB)]
#: The smallest ``context_window`` an agent may declare: a summary request's instructions,
#: its framing, the summary so far and the reply (each up to a quarter) must leave room.
MIN_CONTEXT_WINDOW = 1_024
#: the least of ``context_window`` an agent's ``max_tokens`` must leave for the request's
#: messages (the context engine's own clause and cut marker take about 240)
MIN_PROMPT_TOKENS = 256
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=MAX_KNOB)]
#: The name of an environment variable that holds a secret (never the secret itself: a
#: config's values are recorded, and a key pasted here would be in the log for good).
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
#: What a secret pasted where an environment variable's name belongs looks like (it passes
#: :data:`EnvName`'s pattern): a vendor's token prefix (Stripe, GitHub, AWS access keys,
#: Google API keys, Hugging Face), or a random-looking run of 32+ letters and digits
#: mixing upper case, lower case and digits, which no variable's name has.
_SECRET_SHAPED = re.compile(
    r"^(?:(?:sk|rk|pk)_(?:live|test)_|gh[pousr]_|github_pat_|AIza|hf_[A-Za-z]{20})"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|(?=[A-Za-z0-9]*[a-z])(?=[A-Za-z0-9]*[A-Z])(?=[A-Za-z0-9]*[0-9])[A-Za-z0-9]{32,}"
)


class StoreSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the event log lives and how it is kept: a fold saves a snapshot once it went
    ``snapshot_every`` events past its newest one (0: never); a tailing reader looks for
    another process's appends every ``tail_poll_ms`` (None: the backend's own, 10 ms for
    LMDB, 50 ms for PostgreSQL). Both apply to a store the runtime or the CLI opens from
    this config (:func:`stalwart.store.open_configured`), not to a store object the host
    passes in."""

    location: Annotated[str, msgspec.Meta(min_length=1)] = ".stalwart"
    snapshot_every: NonNegative = 500
    tail_poll_ms: Annotated[int, msgspec.Meta(ge=1, le=1000)] | None = None

    def __repr__(self) -> str:  # a postgresql:// location may carry a password
        return _repr_hiding(self, "location", keep_path=True)


class ProviderSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One LLM endpoint. ``kind`` picks the wire protocol; the key comes from an env var."""

    kind: Literal["openai", "anthropic"]
    base_url: str
    api_key_env: EnvName | None = None
    connect_timeout_ms: Positive = 10_000
    max_in_flight: Positive = 64
    breaker_failure_threshold: Positive = 5
    breaker_reset_timeout_ms: Positive = 60_000

    def __repr__(self) -> str:  # user info in the url is a password
        return _repr_hiding(self, "base_url", keep_path=True)


class AgentSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an agent calls its model: the seed's prompt-timeout knobs and the fallback chain,
    and its loop's limits.

    Models in ``fallback_models`` and ``vision_fallback_models`` are ``provider:model``.
    The loop makes at most ``max_steps`` model calls per turn and runs at most
    ``tool_limit`` tool calls at once; ``system_prompt``, when set, starts every request.
    ``subagents`` offers its model the built-in ``spawn_subagent`` tool. ``context_window``
    is the model's window in tokens (at least ``MIN_CONTEXT_WINDOW``, 1 024: less leaves a
    summary request no room for messages): the context engine fits every request into
    it, less the reply (``max_tokens``), the tool declarations and the system prompt.
    (The turn's execution timeout is ``supervision.execution_timeout_ms`` and a send's
    deadline ``dead_letters.announce_timeout_ms``.)
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
    max_steps: Positive = 10
    tool_limit: Positive = 4
    system_prompt: str | None = None
    subagents: bool = False
    context_window: Annotated[int, msgspec.Meta(ge=MIN_CONTEXT_WINDOW, le=MAX_KNOB)] = 128_000


def _ordered(
    section: str, low: str, low_value: int, high: str, high_value: int, *, strict: bool = False
) -> None:
    """ConfigError naming ``section.high`` unless ``low_value <= high_value`` (``<`` when
    ``strict``)."""
    if low_value > high_value or (strict and low_value == high_value):
        sign = ">" if strict else ">="
        raise ConfigError(
            f"key '{section}.{high}': must be {sign} {section}.{low} ({low_value}), "
            f"found {high_value}",
            key=f"{section}.{high}",
        )


class ClassTimeouts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seed 002's timeout table by task class (ms): every spawn names one or a custom one."""

    formatting: Positive = 120_000
    code: Positive = 300_000
    research: Positive = 600_000
    deep: Positive = 900_000


class SubagentSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sub-agent timeouts (seeds 000 and 002).

    A run's limit is its class timeout, a custom timeout (``<= custom_max_ms``, with a
    reason) or ``max_run_timeout_ms``; the watchdog fires at ``min(max_steps x
    per_step_timeout_ms, limit)``; a run still running at ``limit + ghost_grace_ms`` is
    swept (every ``ghost_sweep_interval_ms``). The heartbeat sweep (every
    ``heartbeat_interval_ms``) flags a run suspicious once it has run ``expected_fraction``
    of its watchdog limit with no token growth for a whole interval; it never kills.
    A failed run is escalated from attempt ``recovery_max_attempts`` on. Successful
    completions are announced batched per parent: a batch goes ``announce_debounce_ms``
    after its latest completion, and never later than ``announce_max_wait_ms`` after its
    first.
    """

    per_step_timeout_ms: Positive = 60_000
    max_run_timeout_ms: Positive = 600_000
    ghost_grace_ms: NonNegative = 120_000
    ghost_sweep_interval_ms: Positive = 60_000
    heartbeat_interval_ms: Positive = 60_000
    expected_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    class_timeouts_ms: ClassTimeouts = msgspec.field(default_factory=ClassTimeouts)
    custom_max_ms: Positive = 1_800_000
    recovery_max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 2
    announce_debounce_ms: Positive = 500
    announce_max_wait_ms: Positive = 5_000

    def __post_init__(self) -> None:
        _ordered(
            "subagents", "max_run_timeout_ms", self.max_run_timeout_ms, "custom_max_ms",
            self.custom_max_ms,
        )  # fmt: skip

    @property
    def longest_run_ms(self) -> int:
        """The longest limit a run can be given: a class timeout, ``custom_max_ms`` or
        ``max_run_timeout_ms``."""
        classes: tuple[int, ...] = msgspec.structs.astuple(self.class_timeouts_ms)
        return max(self.max_run_timeout_ms, self.custom_max_ms, *classes)

    @property
    def spawn_wait_ms(self) -> int:
        """How long the ``spawn_subagent`` tool waits for its run and the retries its
        recovery starts (``recovery_max_attempts`` attempts), a last resort behind their
        own limits: for each attempt the longest limit and the ghost sweep's grace and
        interval (a run whose watchdog never fired is swept by then), and a minute to
        spare."""
        sweep = self.ghost_grace_ms + self.ghost_sweep_interval_ms
        return self.recovery_max_attempts * (self.longest_run_ms + sweep) + 60_000


class HealthSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seed 000's provider health monitor: within ``window_ms``, failures from
    ``min_agents`` agents or ``consecutive_failures`` in a row from one agent degrade it."""

    window_ms: Positive = 60_000
    min_agents: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2
    consecutive_failures: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3


class DeadLetterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The announcement path (seed 000): ``announce_timeout_ms`` before a direct send, then
    the dead-letter queue: ``max_retries`` with deterministic exponential backoff
    (``min(retry_cap_ms, retry_base_ms x 2**n)``), expiry at ``max_age_ms``. At close,
    the sessions' sends in flight get up to ``close_grace_ms`` to end and be recorded
    before the Agents stop (0: cut them short at once; the next runtime sends them
    again)."""

    announce_timeout_ms: Positive = 30_000
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = 5
    max_age_ms: Positive = 3_600_000
    retry_base_ms: Positive = 30_000
    retry_cap_ms: Positive = 600_000
    close_grace_ms: Annotated[int, msgspec.Meta(ge=0, le=600_000)] = 5_000

    def __post_init__(self) -> None:
        _ordered(
            "dead_letters", "retry_base_ms", self.retry_base_ms, "retry_cap_ms", self.retry_cap_ms
        )


class SupervisionSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """one_for_one restart intensity (more than ``max_restarts`` in ``within_ms`` gives up),
    restart backoff ``min(cap, base x 2**n)``, and seed 000's execution backstop."""

    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 3
    within_ms: Positive = 5_000
    restart_backoff_base_ms: Positive = 100
    restart_backoff_cap_ms: Positive = 1_000
    execution_timeout_ms: Positive = 600_000

    def __post_init__(self) -> None:
        _ordered(
            "supervision", "restart_backoff_base_ms", self.restart_backoff_base_ms,
            "restart_backoff_cap_ms", self.restart_backoff_cap_ms,
        )  # fmt: skip


class ActivationSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seed 003's activations: a wake holds a lease of ``lease_ttl_ms``, renewed every
    ``renew_every_ms``; a retryable failure requeues after ``min(backoff_cap_ms,
    backoff_base_ms x 2**(n-1))`` (plus up to ``jitter_ms``, recorded) until
    ``max_attempts`` failures abandon it; delayed wakes are capped at
    ``max_pending_wakes`` per session and ``max_wake_horizon_ms`` ahead. A worker polls
    the work queue every ``poll_ms``, claiming up to ``claim_batch`` due sessions at a
    time and keeping other workers off them for ``claim_hold_ms`` while it decides. An
    idle session's Agent is stopped after ``passivate_after_ms`` and rebuilt on its next
    wake. A staged draft holds at most ``max_draft_bytes``."""

    lease_ttl_ms: Positive = 30_000
    renew_every_ms: Positive = 10_000
    backoff_base_ms: Positive = 2_000
    backoff_cap_ms: Positive = 30_000
    jitter_ms: NonNegative = 0
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 5
    max_pending_wakes: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100
    max_wake_horizon_ms: Positive = 30 * 24 * 3_600_000
    poll_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)] = 1_000
    claim_batch: Annotated[int, msgspec.Meta(ge=1, le=1_000)] = 8
    claim_hold_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = 5_000
    passivate_after_ms: NonNegative = 300_000
    max_draft_bytes: Positive = 262_144

    def __post_init__(self) -> None:
        _ordered(
            "activations",
            "backoff_base_ms",
            self.backoff_base_ms,
            "backoff_cap_ms",
            self.backoff_cap_ms,
        )
        # a renewal due when the lease expires races its takeover: renew well before
        _ordered(
            "activations",
            "renew_every_ms",
            self.renew_every_ms,
            "lease_ttl_ms",
            self.lease_ttl_ms,
            strict=True,
        )


class ChannelSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where user-facing text goes: ``console``, ``webhook`` or ``memory`` (tests).

    A webhook POSTs JSON to ``url`` within ``timeout_ms`` per attempt, up to
    ``max_attempts`` times with full-jitter backoff (``retry_base_ms``, ``retry_cap_ms``;
    a Retry-After up to ``retry_cap_ms`` is honoured). ``secret_header`` carries the value
    of the env var ``secret_env``. The url is recorded with the config: keep secrets in the
    header, not in the url.
    """

    kind: Literal["console", "webhook", "memory"]
    url: str | None = None
    secret_header: str | None = None
    secret_env: EnvName | None = None
    timeout_ms: Positive = 10_000
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    retry_base_ms: Positive = 500
    retry_cap_ms: Positive = 5_000

    def __repr__(self) -> str:  # the url's path or query may hold a token
        return _repr_hiding(self, "url", keep_path=False)


def _repr_hiding(settings: msgspec.Struct, field: str, *, keep_path: bool) -> str:
    """``settings``' repr with the url in ``field`` shown without its secrets (user info,
    query; the path too unless ``keep_path``)."""
    values = {f: getattr(settings, f) for f in settings.__struct_fields__}
    url = values[field]
    if isinstance(url, str) and "://" in url:
        try:
            values[field] = _without_secrets(url, keep_path=keep_path)
        except ValueError:  # not a url at all (an unbalanced '[')
            values[field] = "<a url that cannot be read>"
    shown = ", ".join(f"{f}={v!r}" for f, v in values.items())
    return f"{type(settings).__name__}({shown})"


def _origin(url: str) -> str:
    """``'scheme://host:port/...'`` of a url: no user info, path or query."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/..."


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def url_problem(url: str) -> str | None:
    """What makes ``url`` unusable for HTTP (a webhook, a provider), or None; never
    echoes the url."""
    if not url.startswith(("http://", "https://")):
        return "must start with http:// or https://"
    if any(c.isspace() for c in url):  # sent percent-encoded: a host no one has, a 404
        return "contains whitespace (a url has none: encode a space in a path as %20)"
    if any(unicodedata.category(c) == "Cf" for c in url):  # as whitespace, but unseen
        return (
            "contains an invisible format character (a zero-width space, a byte-order "
            "mark, a soft hyphen or a direction mark pasted with it): type the url again"
        )
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number in 0..65535
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL):
        return "not a valid url (check its host and port)"
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "has port 0"
    return None


def looks_like_secret(name: str) -> bool:
    """Whether ``name``, given as an environment variable's name, looks like a secret."""
    return _SECRET_SHAPED.search(name) is not None


def _check_env_name(key: str, name: str | None) -> None:
    """ConfigError when ``name`` looks like a secret rather than a variable's name; the
    message never shows it (a config is recorded, and so would the secret be)."""
    if name is not None and looks_like_secret(name):
        raise ConfigError(
            f"key '{key}': this looks like a secret itself, not the name of an environment "
            "variable: put the secret in a variable and name that variable here",
            key=key,
        )


def _check_channel(where: str, channel: ChannelSettings) -> None:
    """What msgspec cannot say about one channel; never echoes the url (it may hold a token)."""

    def fail(key: str, problem: str) -> NoReturn:
        raise ConfigError(f"key '{where}.{key}': {problem}", key=f"{where}.{key}")

    if channel.kind == "webhook":
        if channel.url is None:
            fail("url", "a webhook channel needs a url")
        problem = url_problem(channel.url)
        if problem is not None:
            fail("url", problem)
    else:
        for key in ("url", "secret_header", "secret_env"):
            if getattr(channel, key) is not None:
                fail(key, f"only a webhook channel has one (this one is {channel.kind!r})")
    if (channel.secret_header is None) != (channel.secret_env is None):
        missing = "secret_env" if channel.secret_env is None else "secret_header"
        fail(missing, "secret_header and secret_env go together: set both or neither")
    if channel.secret_header is not None and not _HEADER_NAME.fullmatch(channel.secret_header):
        # never the value: a whole header line pasted here holds the secret itself
        fail("secret_header", "not a valid HTTP header name (letters, digits and -; no ':')")
    _check_env_name(f"{where}.secret_env", channel.secret_env)
    _ordered(where, "retry_base_ms", channel.retry_base_ms, "retry_cap_ms", channel.retry_cap_ms)


class SummarizerSpendSettings(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True
):
    """Seed 000's rolling per-tenant caps on summarizer input+output tokens (0 disables).
    A call still running counts what it may spend until it ends, or, if its worker died
    without recording its end, for ``reservation_lease_ms``."""

    max_tokens_per_tenant_per_hour: NonNegative = 500_000
    max_tokens_per_tenant_per_day: NonNegative = 5_000_000
    reservation_lease_ms: Positive = 300_000


class SummarizerBreakerSettings(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True
):
    """The summarizer breaker: open after ``failure_threshold`` consecutive failures for
    ``reset_timeout_ms``, then one trial that must answer within ``half_open_timeout_ms``."""

    failure_threshold: Positive = 5
    reset_timeout_ms: Positive = 60_000
    half_open_timeout_ms: Positive = 30_000


class RelevanceSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Relevance-first assembly: None follows the model's capability (small models on a
    non-caching provider); True or False forces it. Never on a caching profile.
    ``recent_user_turns`` user messages make the query the middle band is ranked by."""

    first_by_default: bool | None = None
    recent_user_turns: Annotated[int, msgspec.Meta(ge=1, le=50)] = 3


#: the observation tier of a tool's results in the pipeline engine
ObservationTier = Literal["protected", "standard", "ephemeral"]


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The pipeline engine's config. The first nine knobs are the seed's
    (``thinkingKeepTurns`` ... ``compactionPrefixAnchorTurns`` and the 85% threshold);
    the rest are ours, documented in ``docs/context-pipeline.md``."""

    thinking_keep_turns: NonNegative = 10
    history_turns: Positive = 15
    eviction_min_age: NonNegative = 15
    observation_keep_window: NonNegative = 25
    observation_trigger_chars: NonNegative = 120_000
    ephemeral_keep_window: NonNegative = 10
    compaction_cooldown_turns: NonNegative = 5
    compaction_prefix_anchor_turns: NonNegative = 2
    #: a fraction of the budget (0.85, not 85)
    compaction_threshold: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.85
    #: the newest user turns compaction keeps verbatim (fewer if they alone pass the
    #: threshold; never fewer than one)
    compaction_tail_turns: Positive = 10
    #: the most a summary may be, in tokens
    summary_max_tokens: Positive = 2_000
    #: the observation tier of each tool by name; unnamed tools are ``default_tier``
    observation_tiers: dict[str, ObservationTier] = msgspec.field(default_factory=dict)
    default_tier: ObservationTier = "standard"
    #: the agent's instructions file, read through the engine's reader after compaction
    instructions_file: str | None = "AGENTS.md"
    rehydrate_max_files: NonNegative = 5
    rehydrate_max_chars: NonNegative = 8_000
    #: on a caching provider, how many user turns the cache fence holds what was sent
    #: before it unchanged before the layers shape it again (0: no fence)
    cache_fence_turns: NonNegative = 5
    #: consecutive failures that disable a layer, and how long until its half-open trial
    layer_failure_limit: Positive = 3
    layer_retry_after_s: Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0 * 365)] = 600.0


def parse_pipeline(knobs: dict[str, Any]) -> PipelineConfig:
    """The pipeline engine's config from ``context_engine.pipeline``; ConfigError naming
    the key when it is not one of ``PipelineConfig``'s, or out of shape."""
    try:
        return msgspec.convert(knobs, PipelineConfig)
    except msgspec.ValidationError as exc:
        # the knob msgspec names: out of shape (at `$.knob`), or not one (unknown field)
        message = str(exc)
        at = re.search(r"at `\$\.(\w+)[^`]*`$|unknown field `([^`]+)`", message)
        knob = at and (at.group(1) or at.group(2))
        key = "context_engine.pipeline" + (f".{knob}" if knob else "")
        shaped = at.group(1) if at else None  # a knob out of shape: say what it holds
        found = f", found {_shown(knobs[shaped])}" if shaped in knobs else ""
        raise ConfigError(f"key {key!r}: {_expected(message)}{found}", key=key) from None


class ContextEngineSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seed 001's context engine. ``version`` is operator-only: an agent's config patch
    that touches it is refused (:func:`apply_agent_patch`). The DAG engine keeps the last
    ``fresh_tail_turns`` user turns verbatim, summarizes the oldest chunk (up to
    ``leaf_chunk_tokens``) once the assembled context passes ``context_threshold`` x the
    budget, folds ``condensed_min_fanout`` same-depth summaries into a deeper one, and
    lets ``ctx_expand`` return at most ``expand_max_tokens`` per call. The ContextStore
    works on at most ``parallel_sessions`` sessions at once (one waiting on its
    summarizer does not hold up the others)."""

    version: Literal["dag", "pipeline"] = "dag"
    fresh_tail_turns: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 8
    context_threshold: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.75
    condensed_min_fanout: Annotated[int, msgspec.Meta(ge=2, le=64)] = 4
    leaf_chunk_tokens: Positive = 20_000
    summary_max_tokens: Positive = 1_200
    expand_max_tokens: Positive = 8_000
    parallel_sessions: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    relevance: RelevanceSettings = msgspec.field(default_factory=RelevanceSettings)
    summarizer_spend: SummarizerSpendSettings = msgspec.field(
        default_factory=SummarizerSpendSettings
    )
    summarizer_breaker: SummarizerBreakerSettings = msgspec.field(
        default_factory=SummarizerBreakerSettings
    )
    #: the pipeline engine's knobs (:class:`PipelineConfig`'s fields:
    #: ``history_turns``, ``observation_trigger_chars``, ``compaction_threshold`` ...),
    #: checked with the rest of the config
    pipeline: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pipeline:
            parse_pipeline(self.pipeline)
        # a summary's requests are bounded by half_open_timeout_ms: a call still running
        # must hold its reservation, or the caps would not count it
        lease = self.summarizer_spend.reservation_lease_ms
        bound = self.summarizer_breaker.half_open_timeout_ms
        if lease <= bound:
            key = "context_engine.summarizer_spend.reservation_lease_ms"
            raise ConfigError(
                f"key '{key}': must be > context_engine.summarizer_breaker."
                f"half_open_timeout_ms ({bound}), found {lease}",
                key=key,
            )


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole runtime configuration; recorded in ``runtime:started``."""

    store: StoreSettings = msgspec.field(default_factory=StoreSettings)
    providers: dict[str, ProviderSettings] = msgspec.field(default_factory=dict)
    agents: dict[str, AgentSettings] = msgspec.field(default_factory=dict)
    subagents: SubagentSettings = msgspec.field(default_factory=SubagentSettings)
    health: HealthSettings = msgspec.field(default_factory=HealthSettings)
    dead_letters: DeadLetterSettings = msgspec.field(default_factory=DeadLetterSettings)
    supervision: SupervisionSettings = msgspec.field(default_factory=SupervisionSettings)
    activations: ActivationSettings = msgspec.field(default_factory=ActivationSettings)
    channels: dict[str, ChannelSettings] = msgspec.field(default_factory=dict)
    context_engine: ContextEngineSettings = msgspec.field(default_factory=ContextEngineSettings)

    def __post_init__(self) -> None:
        for name, channel in self.channels.items():
            _check_channel(f"channels.{name}", channel)
        for name, provider in self.providers.items():
            if not name or ":" in name:  # a model is named 'provider:model'
                raise ConfigError(
                    f"key 'providers.{name}': a provider's name cannot be empty or hold a "
                    "':' (models are named 'provider:model')",
                    key=f"providers.{name}",
                )
            problem = url_problem(provider.base_url)  # never echoes it: user info is a password
            if problem is not None:
                key = f"providers.{name}.base_url"
                raise ConfigError(f"key '{key}': {problem}", key=key)
            _check_env_name(f"providers.{name}.api_key_env", provider.api_key_env)
        for name, agent in self.agents.items():
            where = f"agents.{name}"
            if not agent.model.strip():  # as a fallback model's, an empty name is no model
                raise ConfigError(f"key '{where}.model': must name a model", key=f"{where}.model")
            base, cap = agent.retry_base_ms, agent.retry_cap_ms
            _ordered(where, "retry_base_ms", base, "retry_cap_ms", cap)
            if agent.context_window - agent.max_tokens < MIN_PROMPT_TOKENS:
                raise ConfigError(
                    f"key '{where}.max_tokens': must leave at least {MIN_PROMPT_TOKENS} of "
                    f"{where}.context_window ({agent.context_window}) for the conversation, "
                    f"found {agent.max_tokens}",
                    key=f"{where}.max_tokens",
                )
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
                            f"key '{where}.{key}': {_shown(entry)} must be 'provider:model' with a "
                            f"configured provider (configured: {sorted(self.providers) or 'none'})",
                            key=f"{where}.{key}",
                        )

    def to_record(self) -> dict[str, Any]:
        """The config as ``runtime:started`` records it: everything replay needs, and no
        secret a URL may carry (user info and query strings go; a webhook keeps only its
        origin, since services like chat webhooks put the token in the path)."""
        data: dict[str, Any] = msgspec.to_builtins(self)
        for entry in data.get("providers", {}).values():
            entry["base_url"] = _without_secrets(entry["base_url"], keep_path=True)
        for entry in data.get("channels", {}).values():
            if entry.get("url"):
                entry["url"] = _without_secrets(entry["url"], keep_path=False)
        store = data.get("store", {})
        if "://" in store.get("location", ""):  # a postgresql:// URL may carry a password
            store["location"] = _without_secrets(store["location"], keep_path=True)
        return data

    def agent(self, name: str = "default") -> AgentSettings:
        """The named agent's settings, or ConfigError listing the configured ones."""
        try:
            return self.agents[name]
        except KeyError:
            raise ConfigError(
                f"no agent named {name!r} (configured: {sorted(self.agents) or 'none'})",
                key=f"agents.{name}",
            ) from None


def _without_secrets(url: str, *, keep_path: bool) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port
    except ValueError:  # a port that is not one (a store location is not checked as a URL)
        return "<a url that cannot be read>"
    origin = f"{parts.scheme}://{host}" + (f":{port}" if port else "")
    if not keep_path:
        return f"{origin}/..." if parts.path.strip("/") else origin
    return origin + parts.path


#: Config keys an agent's own patch may never touch (``*``: any name). Seed 001: the
#: engine decides which recall tools the agent has, so switching it would change its own
#: tool exposure; ``subagents`` gives it the spawn tool likewise. The providers (where its
#: API key goes), the store (the log) and the channels (where users' text goes, with their
#: secrets) are the operator's too.
OPERATOR_ONLY_KEYS = (
    "context_engine.version",
    "agents.*.subagents",
    "providers",
    "store",
    "channels",
)


def apply_agent_patch(config: Config, patch: dict[str, Any]) -> Config:
    """``config`` with an agent's patch merged in (nested dicts merge, other values
    replace), or ConfigError naming the key when the patch touches an operator-only key
    (:data:`OPERATOR_ONLY_KEYS`), replaces a section holding one, or makes an invalid
    config. Pure: the caller logs."""
    for key in OPERATOR_ONLY_KEYS:
        touched = _touched(patch, key.split("."), [])
        if touched is not None:
            raise ConfigError(
                f"key {touched!r} is operator-only: an agent may not change it", key=touched
            )
    merged = _merge(msgspec.to_builtins(config), patch)  # not to_record: it drops secrets
    return parse_config(merged, source="agent config patch")


def _touched(patch: Any, path: list[str], at: list[str]) -> str | None:
    """The operator-only key ``path`` (below ``at``) that ``patch`` sets, or replaces with
    a section holding it, or None."""
    if not path:
        return ".".join(at)
    if not isinstance(patch, dict):  # replaces the whole section, the key with it
        return ".".join([*at, *path])
    head, rest = path[0], path[1:]
    for name in patch if head == "*" else [head] if head in patch else []:
        touched = _touched(patch[name], rest, [*at, str(name)])
        if touched is not None:
            return touched
    return None


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return patch
    out = dict(base)
    for key, value in patch.items():
        out[key] = _merge(base.get(key), value)
    return out


#: where msgspec says a value is, at the end of its message (a value it quotes may look
#: like one): ``at `$.a.b` `` for a value, ``at `key` in `$.a` `` for a table's key
_PATH = re.compile(r"at (`key` in )?`\$((?:\.[A-Za-z_][\w]*|\[\d+\])*)`$")


def parse_config(data: Any, *, source: str = "config") -> Config:
    """A Config from already-parsed TOML/YAML data."""
    if data is None:
        data = {}
    if isinstance(data, dict):
        # msgspec hides dict keys in its paths ("$.providers[...]"): check entries one by
        # one so that an error names the provider, agent or channel it is about
        for section, kind in (
            ("providers", ProviderSettings),
            ("agents", AgentSettings),
            ("channels", ChannelSettings),
        ):
            entries = data.get(section)
            if isinstance(entries, dict):
                for name, entry in entries.items():
                    if not isinstance(name, str):  # YAML reads `1:` as an int
                        _not_a_name(source, section, name)
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
    inner = match.group(2).lstrip(".") if match else ""
    key = ".".join(part for part in (prefix, inner) if part) or None
    if match and match.group(1):  # a key of the table at ``inner`` is not a string
        table = _lookup(data, inner) if inner else data
        names = table if isinstance(table, dict) else {}
        _not_a_name(source, key, next((n for n in names if not isinstance(n, str)), None))
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        raise ConfigError(f"{source}: unknown key {key!r}", key=key) from None
    if key is not None and key.endswith("_env"):  # the value may be the secret itself
        raise ConfigError(
            f"{source}: key {key!r}: must be the name of an environment variable (letters, "
            "digits and _; not the secret itself, which is not shown here)",
            key=key,
        ) from None
    expected = _expected(message)
    allowed = _allowed(root, inner)
    if allowed:
        expected = f"{expected}; allowed: {', '.join(repr(v) for v in allowed)}"
    found = _lookup(data, inner) if inner else data
    where = f"key {key!r}: " if key else ""
    raise ConfigError(f"{source}: {where}{expected}, found {_shown(found)}", key=key) from None


def _not_a_name(source: str, table: str | None, name: Any) -> NoReturn:
    """ConfigError naming a key of ``table`` that is not a string (YAML reads ``1:`` as
    an int, ``yes:`` as a bool)."""
    key = f"{table}.{name}" if table else str(name)
    raise ConfigError(
        f"{source}: key {key!r}: a name must be a string, found {type(name).__name__} "
        f"{name!r} (quote it)",
        key=key,
    ) from None


def _shown(found: Any) -> str:
    """What a config error may say it found: never a whole table or list (a provider's or
    a channel's URL in it may hold a password or a token), a URL without its secrets."""
    if isinstance(found, dict):
        return "a table"
    if isinstance(found, list | tuple):
        return "a list"
    if isinstance(found, str) and "://" in found:
        try:
            return repr(_origin(found))
        except ValueError:
            return "a URL that cannot be read"
    return repr(found)


def _allowed(root: type, path: str) -> tuple[Any, ...]:
    """The values a Literal field allows, to say them in the error."""
    info: Any = msgspec.inspect.type_info(root)
    for part in path.split(".") if path else ():
        fields = {f.name: f.type for f in getattr(info, "fields", ())}
        info = fields.get(part)
        if info is None:
            return ()
    return tuple(getattr(info, "values", ()))


#: msgspec's message for a value a Literal refuses quotes it whole: what was found is
#: said apart, through :func:`_shown` (a URL pasted there may hold a password or a token)
_QUOTED_VALUE = re.compile(r"^(Invalid (?:enum )?value) .*", re.DOTALL)


def _expected(message: str) -> str:
    """What msgspec's ``message`` says was expected, without where, nor the value found."""
    return _QUOTED_VALUE.sub(r"\1", message.split(" - at ", maxsplit=1)[0])


#: a part of a msgspec path: a table's key, or a list's ``[index]``
_PART = re.compile(r"\[(\d+)\]|[^.\[]+")


def _lookup(data: Any, key: str) -> Any:
    for part in _PART.finditer(key):
        index = part.group(1)
        if index is None and isinstance(data, dict):
            data = data.get(part.group(0))
        elif index is not None and isinstance(data, list | tuple) and int(index) < len(data):
            data = data[int(index)]
        else:
            return data
    return data


#: The largest config (or fake-provider script) file read: a config is a few KB; a
#: path to a device or a huge file by mistake must not fill the memory.
MAX_DOCUMENT_BYTES = 16 * 2**20


def read_document(path: str | os.PathLike[str], what: str = "config") -> Any:
    """The parsed data of a TOML, YAML (``.yaml``/``.yml``) or JSON (``.json``) file;
    ConfigError naming the file (and the first line of the parser's complaint) otherwise."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            raw = handle.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {name}: {exc.strerror}") from None
    if len(raw) > MAX_DOCUMENT_BYTES:  # /dev/zero, a log given by mistake: never read whole
        raise ConfigError(f"{what} {name} is larger than {MAX_DOCUMENT_BYTES // 2**20} MiB")
    try:
        if name.endswith((".yaml", ".yml")):
            return yaml.load(raw, Loader=_UniqueKeys)  # a SafeLoader: no arbitrary objects
        if name.endswith(".json"):
            return json.loads(raw, object_pairs_hook=_unique_pairs)
        # utf-8-sig: a byte-order mark (PowerShell's "UTF8") is no statement
        return tomllib.loads(raw.decode("utf-8-sig"))
    except RecursionError:
        raise ConfigError(f"{name} is not valid TOML/YAML/JSON: nested too deeply") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{name} is not valid TOML/YAML/JSON: {first}") from None


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping, as TOML does (the
    plain loader keeps the last one silently: two ``agents.triage`` entries, one lost)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                again = key in seen
            except TypeError:  # unhashable: the base loader says so
                break
            if again:
                raise yaml.constructor.ConstructorError(
                    None, None, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (``json`` keeps the last one silently)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"found duplicate key {key!r}")
        found[key] = value
    return found


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read a TOML (``.toml``), YAML (``.yaml``/``.yml``) or JSON config file."""
    return parse_config(read_document(path), source=os.fspath(path))
