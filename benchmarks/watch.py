"""``stalwart watch`` on a store that has served many sessions: what one frame costs.

A live view folds the log once, then every second folds what was appended and draws a
frame. Measured on an orchestrator folder of 20,000 sessions (2,000 with ``--quick``),
two events each, built in memory (the read of what is new is the store's, measured by
``replay`` and ``tail_latency``):

- ``first_fold_ms``: folding every record (what ``watch`` does once as it starts);
- ``frame_ms``: one more event, then a frame for a 30-line terminal (the default of a
  live ``watch``), best of the rounds;
- the peer, ``whole_overview_ms``: the same event and a frame with every session's row
  (what ``status`` prints, and what each frame rebuilt before the folder kept its
  views and a frame made rows only for what it shows).

Goals: a frame costs a small part of the peer (``whole_vs_frame`` >= 10) and stays
under 20 ms at 20,000 sessions (a 1 s redraw spends at most 2% of a core).
"""

from __future__ import annotations

import time

from benchmarks._registry import Result, benchmark, ratio
from stalwart.cli._watch import frame
from stalwart.events import Event, MessageAppended, RecordedEvent, SessionCreated
from stalwart.state import OrchestratorFolder
from stalwart.testing import recorded

T0 = 1_800_000_000.0
HEIGHT = 29  # a 30-line terminal, less the line the cursor ends on


def _record(position: int, stream: str, version: int, event: Event) -> RecordedEvent:
    return recorded(event, stream=stream, version=version, ts=T0 + position, position=position)


def _log(sessions: int) -> list[RecordedEvent]:
    records: list[RecordedEvent] = []
    for k in range(sessions):
        stream = f"session:s{k:06d}"
        created = SessionCreated(title="t", agent="a")
        message = MessageAppended(message_id=f"m{k}", role="user", content="hello")
        records.append(_record(len(records) + 1, stream, 1, created))
        records.append(_record(len(records) + 1, stream, 2, message))
    return records


def _frame_ms(folder: OrchestratorFolder, position: int, height: int | None) -> float:
    """One event (to a session in the middle), then a frame: its cost in ms."""
    event = MessageAppended(message_id=f"late{position}", role="user", content="again")
    started = time.perf_counter()
    folder.add(_record(position, "session:s000100", position, event))
    frame(folder, "bench", None, height)
    return (time.perf_counter() - started) * 1000


@benchmark("watch")
def run(quick: bool) -> Result:
    result = Result("watch")
    figures = result.figures
    sessions = 2_000 if quick else 20_000
    rounds = 3 if quick else 7
    records = _log(sessions)
    started = time.perf_counter()
    folder = OrchestratorFolder()
    for record in records:
        folder.add(record)
    folder.state()
    figures["sessions"] = sessions
    figures["first_fold_ms"] = (time.perf_counter() - started) * 1000
    position = len(records)
    fitted, whole = [], []
    for _ in range(rounds):
        position += 1
        fitted.append(_frame_ms(folder, position, HEIGHT))
        position += 1
        whole.append(_frame_ms(folder, position, None))
    figures["frame_ms"] = min(fitted)
    figures["whole_overview_ms"] = min(whole)
    result.ratios["whole_vs_frame"] = ratio(min(whole), min(fitted))
    result.goal("whole_vs_frame", ">=", 10.0)
    result.goal("frame_ms", "<=", 20.0)
    return result
