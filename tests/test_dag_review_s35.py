"""Review of the DAG context engine and its recall tools (session 35): a system prompt of
several messages cut to fit is recoverable whole by the id its marker names, a
transcript whose times are in milliseconds is simulated, and a session's first search
does not hold every other session's assembly while its index is built."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest
from click.testing import CliRunner

from stalwart.actors import (
    Assemble,
    ContextStoreActor,
    SearchContext,
    ask_context,
    context_tools,
)
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import ContextMessage, ExtractiveSummarizer
from stalwart.store import EventStore

ASK = 60.0  # real seconds an answer may take on a loaded machine


@pytest.fixture
def context_store(store: EventStore, clock: FakeClock) -> Iterator[pykka.ActorRef[Any]]:
    ref = ContextStoreActor.start(
        store=store,
        clock=clock,
        summarizer=ExtractiveSummarizer(),
        settings=ContextEngineSettings(fresh_tail_turns=2),
    )
    yield ref
    ref.stop()


# -- the system prompt's marker names an id that returns it whole ----------------------------


# Was: DEFECT: a cut system prompt of several messages said "ctx_expand id=<first> returns it whole"; that returned the first message only  # noqa: E501
def test_a_cut_system_prompt_of_several_messages_is_returned_whole_by_the_id_it_names(
    context_store: pykka.ActorRef[Any],
) -> None:
    """A transcript may open with several system messages (house rules, then a policy
    document); the engine pins them as one message under the first one's id, and when
    it does not fit, cuts it with a marker: ``ctx_expand id=<first id> returns it
    whole``. Expanding that id returned the first system message alone, and the policy
    the model was told it could read back was nowhere in the answer."""
    policy = "POLICY-7731 refunds need a receipt. " + "clause " * 1_500
    messages = (
        ContextMessage(message_id="rules", seq=0, role="system", content="Be brief."),
        ContextMessage(message_id="policy", seq=1, role="system", content=policy),
        ContextMessage(message_id="u1", seq=2, role="user", content="Can I get a refund?"),
    )
    reply = ask_context(
        context_store,
        Assemble(session_id="s1", messages=messages, budget=1_500, tenant="acme"),
        ASK,
    )
    assert "system_clip" in reply.layers_fired
    shown = reply.messages[0].content
    assert "ctx_expand id=rules returns it whole" in shown
    assert policy not in shown

    tools = context_tools(context_store, "s1", "acme", settings=ContextEngineSettings())
    expand = tools.get("ctx_expand")
    assert expand is not None
    returned: list[str] = []
    after: str | None = None
    offset = 0
    for _ in range(100):  # page through it as the model does
        page = json.loads(expand.fn(id="rules", max_tokens=8_000, after=after, offset=offset))
        returned += [message["content"] for message in page["messages"]]
        after, offset = page.get("next_after"), page.get("next_offset", 0)
        if after is None:
            break
    assert "".join(returned) == "Be brief." + policy


# -- times a calendar cannot show ---------------------------------------------------------------


# Was: DEFECT: `context simulate` of a transcript with times in milliseconds was "internal error: ValueError (a bug)"  # noqa: E501
def test_a_transcript_whose_times_are_in_milliseconds_is_simulated(tmp_path: Path) -> None:
    """A transcript exported from a JavaScript client carries ``ts`` in milliseconds
    (``Date.now()``). The first summary rendered its time range with a year past 9999,
    which ``datetime`` refuses: the simulation stopped with an internal error. A time
    with no calendar date is shown as ``unknown``, as a missing one is."""
    items: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for n in range(40):
        ts = 1_764_000_000_000 + n * 20_000  # milliseconds
        items.append({"role": "user", "content": f"Question {n}. " + "detail " * 150, "ts": ts})
        items.append({"role": "assistant", "content": f"Answer {n}. " + "more " * 150, "ts": ts})
    transcript = tmp_path / "chat.json"
    transcript.write_text(json.dumps(items))

    result = CliRunner().invoke(
        cli,
        ["context", "simulate", "--transcript", str(transcript), "--budget", "4000", "--json"],
    )

    assert result.exit_code == 0, result.output
    final = json.loads(result.output.strip().splitlines()[-1])
    assert final["final"] is True
    assert final["summaries"] > 0
    summaries = [m["content"] for m in final["messages"] if m["content"].startswith("[stalwart:")]
    assert summaries
    assert all("time=unknown/unknown" in summary for summary in summaries)


# -- the first search of a long session ------------------------------------------------------


def _long_session(count: int) -> tuple[ContextMessage, ...]:
    words = [f"w{n}" for n in range(4_000)]
    return tuple(
        ContextMessage(
            message_id=f"m{n}",
            seq=n,
            role="user" if n % 2 == 0 else "assistant",
            content=" ".join(words[(n * 7 + k * 13) % len(words)] for k in range(60)),
        )
        for n in range(count)
    )


# Was: DEFECT: a session's first ctx_search built its index under the store's lock: every other session's assembly waited for it (9 s on 100,000 messages)  # noqa: E501
def test_a_long_sessions_first_search_does_not_hold_other_sessions_assemblies(
    context_store: pykka.ActorRef[Any],
) -> None:
    """The full-text index is built when a session is first searched (after a restart,
    or once the session was let go of): about 90 µs a message. It was built while the
    ContextStore's lock was held, so every other session's assembly (each model call of
    every agent on the worker) waited for it: 9 s for a 100,000-message session, and the
    searching agent's own tool timed out at 10 s. It is built outside the lock, like a
    summarizer call."""
    ask_context(
        context_store,
        Assemble(session_id="big", messages=_long_session(40_000), budget=10**8, tenant="acme"),
        ASK,
    )
    took: dict[str, float] = {}

    def search() -> None:
        started = time.perf_counter()
        hits = ask_context(
            context_store, SearchContext(session_id="big", tenant="acme", query="w17"), ASK
        )
        took["search"] = time.perf_counter() - started
        took["hits"] = len(hits)

    searching = threading.Thread(target=search)
    searching.start()
    time.sleep(0.2)  # real-time: the search's lane starts indexing before the other asks
    other = (ContextMessage(message_id="o1", seq=0, role="user", content="hello"),)
    started = time.perf_counter()
    ask_context(context_store, Assemble(session_id="small", messages=other, budget=4_000), ASK)
    waited = time.perf_counter() - started
    searching.join(ASK)

    assert took["hits"] > 0
    # before: the assembly waited for the whole index (all but the 0.2 s slept)
    assert waited < took["search"] / 2, (waited, took["search"])
