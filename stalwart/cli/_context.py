"""``stalwart context``: watch the context engine work, and recall from a session.

- ``simulate`` feeds a transcript (JSON Lines or a JSON array of OpenAI-style messages, or
  Anthropic content blocks) call by call through an engine with the deterministic
  stand-in summarizer, and reports every call;
- ``search`` and ``expand`` are ``ctx_search`` / ``ctx_expand`` for the operator, over a
  session in the store (its ``context:`` stream and its ``session:`` messages).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from stalwart._text import escaped
from stalwart.actors import IoPortal, ProviderSummarizer
from stalwart.clock import FakeClock
from stalwart.config import Config, ContextEngineSettings, load_config
from stalwart.context import (
    ContextScopeError,
    DagEngine,
    ExtractiveSummarizer,
    Summarizer,
    messages_from_records,
    read_transcript,
)
from stalwart.context._simulate import MODEL_PROFILES, CallReport, simulate
from stalwart.errors import StalwartError
from stalwart.providers import ProviderClient

from ._app import _State, cli
from ._render import to_json


@cli.group()
def context() -> None:
    """The context engine: simulate it on a transcript, search and expand a session."""


@context.command("simulate")
@click.option(
    "--transcript",
    "path",
    required=True,
    type=click.Path(dir_okay=False),
    help="JSON Lines or a JSON array of chat messages.",
)
@click.option(
    "--budget",
    required=True,
    type=click.IntRange(min=1),
    help="The context window to fit, in tokens.",
)
@click.option("--engine", type=click.Choice(["dag", "pipeline"]), default="dag", show_default=True)
@click.option(
    "--model-profile",
    "profile",
    default="caching",
    show_default=True,
    type=click.Choice(sorted(MODEL_PROFILES)),
    help="caching (Anthropic, prompt cache), non-caching, small (relevance-first).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per call, then one with the assembled messages.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Summarize with a real model: this config's agent (--agent) and its provider.",
)
@click.option("--agent", default=None, help="The agent of --config [default: default].")
def simulate_command(
    path: str,
    budget: int,
    engine: str,
    profile: str,
    as_json: bool,
    config_path: str | None,
    agent: str | None,
) -> None:
    """Run a transcript through the engine as an agent would, one call per assistant turn.

    Summaries come from a deterministic stand-in (the same text for the same input), or
    from a real model with --config."""
    if agent is not None and config_path is None:  # it would be ignored: say so
        raise click.UsageError("--agent names an agent of --config: give --config too")
    with contextlib.ExitStack() as stack:
        summarizer: Summarizer = ExtractiveSummarizer()
        if config_path is not None:
            summarizer = _model_summarizer(load_config(config_path), agent or "default", stack)
        _simulate(path, budget, engine, profile, as_json, summarizer)


def _model_summarizer(config: Config, agent: str, stack: contextlib.ExitStack) -> Summarizer:
    settings = config.agent(agent)
    client = ProviderClient(settings.provider, config.providers[settings.provider])
    portal = stack.enter_context(IoPortal())
    stack.callback(lambda: portal.submit(client.aclose).result(timeout=10))
    timeout_s = config.context_engine.summarizer_breaker.half_open_timeout_ms / 1000
    return ProviderSummarizer(
        client, settings.model, portal, timeout_s=timeout_s, window=settings.context_window
    )


def _simulate(
    path: str, budget: int, engine: str, profile: str, as_json: bool, summarizer: Summarizer
) -> None:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise StalwartError(f"cannot read the transcript {path}") from None
    messages = read_transcript(text, source=path)
    if not messages:
        raise StalwartError(f"the transcript {path} has no messages")
    clock = FakeClock(start=max(1.0, messages[0].ts or 1.0))
    totals = {
        "calls": 0,
        "violations": 0,
        "max_tokens": 0,
        "over_budget": 0,
        "summaries": 0,
        "prefix_checked": 0,
        "prefix_unchanged": 0,
    }
    last: CallReport | None = None
    for report in simulate(
        messages,
        budget,
        summarizer=summarizer,
        clock=clock,
        engine="pipeline" if engine == "pipeline" else "dag",
        profile=MODEL_PROFILES[profile],
    ):
        last = report
        _count(totals, report)
        data = msgspec.to_builtins(report)
        data.pop("assembled")
        click.echo(to_json(data) if as_json else _line(report))
    if last is None:
        return
    final: dict[str, Any] = {"final": True, "engine": engine, "budget": budget, **totals}
    if as_json:
        final["messages"] = msgspec.to_builtins(last.assembled)
        click.echo(to_json(final))
        return
    checked = totals["prefix_checked"]
    stable = (
        f"prefix unchanged on {totals['prefix_unchanged'] / checked:.1%} of calls"
        if checked
        else "no cache fence"
    )
    click.echo(
        f"{totals['calls']} calls: max {totals['max_tokens']:,}/{budget:,} tokens, "
        f"{totals['over_budget']} over budget, {totals['violations']} validity violations, "
        f"{totals['summaries']} summaries, {stable}"
    )


def _count(totals: dict[str, int], report: CallReport) -> None:
    totals["calls"] += 1
    totals["violations"] += len(report.violations)
    totals["max_tokens"] = max(totals["max_tokens"], report.tokens)
    totals["over_budget"] += report.tokens > report.budget
    totals["summaries"] += report.summaries_made
    if report.prefix_unchanged is not None:
        totals["prefix_checked"] += 1
        totals["prefix_unchanged"] += report.prefix_unchanged


def _line(report: CallReport) -> str:
    prefix = {None: "-", True: "unchanged", False: "CHANGED"}[report.prefix_unchanged]
    layers = ",".join(report.layers_fired) or "-"
    line = (
        f"call {report.call:>5}  msgs {report.messages_in:>6} -> {report.messages_out:<5} "
        f"tokens {report.tokens:>7,}/{report.budget:,}  violations {len(report.violations)}  "
        f"prefix {prefix:<9}  layers {layers}  summaries {report.summaries_made}"
    )
    if report.cache_break is not None:
        line += f"  cache break {report.cache_break}"
    for problem in report.violations:
        line += f"\n    violation: {problem}"
    return line


def _session(state: _State, stream: str) -> tuple[DagEngine, str, str | None]:
    """The DAG engine rebuilt for one session of the store, its id and tenant."""
    session_id = stream.removeprefix("context:").removeprefix("session:")
    store = state.store()
    try:
        records = list(store.read_stream(f"context:{session_id}"))
        messages = messages_from_records(store.read_stream(f"session:{session_id}"))
    finally:
        store.close()
    if not records:
        raise StalwartError(f"no context stream for session {session_id!r}")
    engine = DagEngine(
        ContextEngineSettings(), summarizer=ExtractiveSummarizer(), clock=FakeClock()
    )
    try:
        rebuilt = engine.restore(session_id, records, messages)
    except ContextScopeError as exc:
        raise StalwartError(f"session {session_id!r}: {exc}") from None
    return engine, session_id, rebuilt.tenant


@context.command("search")
@click.argument("stream")
@click.argument("query")
@click.option("--limit", type=click.IntRange(min=1, max=100), default=10, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per hit.")
@click.pass_obj
def search_command(state: _State, stream: str, query: str, limit: int, as_json: bool) -> None:
    """Full-text (BM25) search over a session's messages and summaries."""
    engine, session_id, tenant = _session(state, stream)
    hits = engine.search(session_id, query, tenant=tenant, limit=limit)
    if not hits and not as_json:
        click.echo("no matches")
    for hit in hits:
        if as_json:
            click.echo(to_json(msgspec.to_builtins(hit)))
            continue
        where = f"  (in {hit.summary_id}, shown as {hit.in_context_as})" if hit.summary_id else ""
        # a message's id is the sender's (a chat platform's), its snippet a model's text
        click.echo(
            f"{hit.score:>8.3f}  {hit.kind:<7} {escaped(hit.id)}  #{hit.seq}{where}\n"
            f"    {escaped(hit.snippet)}"
        )


@context.command("expand")
@click.argument("stream")
@click.argument("summary_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per stored message.")
@click.pass_obj
def expand_command(state: _State, stream: str, summary_id: str, as_json: bool) -> None:
    """Every stored message under a summary (or one message), byte for byte."""
    engine, session_id, tenant = _session(state, stream)
    try:
        info = engine.inspect(session_id, summary_id, tenant=tenant)
        if not as_json:
            fallback = f" fallback={info.fallback}" if info.fallback else ""
            click.echo(
                f"# {summary_id}: depth {info.depth}, {info.descendant_count} messages, "
                f"seq {info.first_seq}-{info.last_seq}{fallback}"
            )
    except ContextScopeError:
        pass  # a message id: expand shows it
    after: str | None = None
    offset = 0
    # byte for byte when piped; on a terminal the stored text (a model's, a tool's: not
    # ours to trust) keeps its line breaks and tabs, any other control character escaped
    shown = _for_terminal if sys.stdout.isatty() else str
    while True:
        try:
            part = engine.expand(session_id, summary_id, tenant=tenant, after=after, offset=offset)
        except ContextScopeError as exc:
            raise StalwartError(str(exc)) from None
        for index, message in enumerate(part.messages):
            continued = index == 0 and part.offset > 0
            if as_json:
                data = msgspec.to_builtins(message)
                data["content_offset"] = part.offset if index == 0 else 0
                click.echo(to_json(data))
            elif continued:
                click.echo(shown(message.content), nl=False, color=True)
            else:
                click.echo(f"\n--- #{message.seq} {message.role} {escaped(message.message_id)}")
                click.echo(shown(message.content), nl=False, color=True)
        if part.next_after is None:
            break
        after, offset = part.next_after, part.next_offset
    if not as_json:
        click.echo()


def _for_terminal(text: str) -> str:
    return "\n".join(escaped(line, tabs=True) for line in text.split("\n"))
