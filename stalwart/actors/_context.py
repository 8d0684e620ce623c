"""ContextStore: the only writer of the ``context:<session>`` streams (seed 001).

Before each provider call an Agent asks it for the session's context::

    ref = ContextStoreActor.start(store=store, clock=clock, summarizer=summarizer,
                                  settings=config.context_engine)
    reply = ask_context(ref, Assemble(session_id=sid, messages=messages, budget=budget,
                                      tenant=tenant, profile=ModelProfile(
                                          provider="anthropic", model=model, caching=True)),
                        timeout=30)
    request = ProviderRequest(messages=reply.messages, ...)

Sessions run side by side. A session's messages (:class:`Assemble`, :class:`SearchContext`,
:class:`InspectContext`, :class:`ExpandContext`) go to that session's lane, where they
run one at a time and in order, and the mailbox answers at once with the lane's future
(:func:`ask_context` waits for both). At most ``context_engine.parallel_sessions`` lanes
run at once (a lane keeps its thread during a summarizer call, so only the sessions
beyond that many wait). The engines' state is shared (a tenant's governor spans its
sessions), so a lane holds the store's lock while it works and lets go of it only while
its summarizer call runs or it builds its session's search index; :class:`Calibrate`
(the estimators) has a lane of its own, so the mailbox never waits on the lock or the
network.

A thin shell: receive, fold (a session it has not seen this run is rebuilt from its
``context:`` stream and the messages the Agent passes), decide (the engine), append the
decisions with a ``context:assembled`` record, and only then reply. In dag mode that is
the :class:`~stalwart.context.DagEngine`; with ``context_engine.version = "pipeline"``,
one :class:`~stalwart.context.pipeline.PipelineEngine` per session. A refused write
(fail-closed rollover) records ``context:dag_degraded`` and the ask raises
:class:`~stalwart.context.ContextScopeError`. Each summarizer call is admitted and
released in its tenant's ledger stream (:class:`~stalwart.actors.StoreLedger`), so spend
caps and the breaker survive a restart and hold across every worker on the store.

:func:`~stalwart.actors.context_tools` gives an agent ``ctx_search`` / ``ctx_inspect`` /
``ctx_expand`` bound to its own session and tenant (dag mode only), and
:class:`~stalwart.actors.ProviderSummarizer` summarizes with a model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from types import TracebackType
from typing import Any

import msgspec

from stalwart._logs import get_logger
from stalwart.clock import Clock
from stalwart.config import ContextEngineSettings
from stalwart.context import (
    ContextMessage,
    ContextScopeError,
    DagEngine,
    ModelProfile,
    Summarizer,
    SummaryRequest,
    valid_session_id,
)
from stalwart.context.pipeline import FileReader, PipelineEngine, parse_pipeline
from stalwart.errors import (
    ConcurrencyError,
    CorruptRecordError,
    InvalidStreamError,
    StoreError,
)
from stalwart.events import (
    ContextCalibrated,
    ContextDagDegraded,
    ContextLayerDisabled,
    ContextLayerEnabled,
    ContextLayerHalfOpened,
    Event,
)
from stalwart.providers import Message
from stalwart.state import CONTEXT_DAG, CONTEXT_PIPELINE, ContextDagState
from stalwart.store import EventStore, Fence, NewEvent, check_stream, load_state

from ._agent_fold import AGENT_VIEW
from ._lanes import Lanes, Turnstile, answer
from ._ledger import StoreLedger
from ._supervised import Supervised

__all__ = [
    "CALIBRATION_STREAM",
    "CALIBRATION_WARM_UP",
    "REFUSALS_STREAM",
    "Assemble",
    "Assembled",
    "Calibrate",
    "ContextStoreActor",
    "ExpandContext",
    "InspectContext",
    "SearchContext",
    "ask_context",
    "to_provider_messages",
]

log = get_logger(__name__)

#: Where a refusal goes whose session id is too malformed to name a stream.
REFUSALS_STREAM = "context-refusals"
#: the lane calibrations run in (no session id is a tuple)
_CALIBRATION = ("calibration",)


class Assemble(msgspec.Struct, frozen=True, kw_only=True):
    """Assemble ``session_id``'s context within ``budget`` tokens: ``messages`` are the
    session's stored messages in order (all of them; the store keeps only what is new)."""

    session_id: str
    messages: tuple[ContextMessage, ...]
    budget: int
    tenant: str | None = None
    profile: ModelProfile = msgspec.field(default_factory=ModelProfile)
    #: the lease epoch of the wake that asks (None outside a wake): what this assembly
    #: appends to ``context:<session>`` is fenced by it, so a worker that lost the
    #: session's lease writes nothing there (FencedError), as in ``session:<session>``
    epoch: int | None = None
    #: the uncalibrated estimate of what the request carries besides the messages and
    #: ``budget`` already leaves out (the system text and tool declarations): the
    #: provider counts it at the model's calibrated factor too (dag mode)
    overhead: int = 0


class Assembled(msgspec.Struct, frozen=True, kw_only=True):
    """The reply: provider messages in order, what the engine did, and the cache fence
    and the ``cache_control`` breakpoints (message indices, at most 4). ``factor`` is the
    model's calibration factor ``tokens`` was counted at (what :class:`Calibrate` names)."""

    messages: tuple[Message, ...]
    tokens: int
    budget: int
    engine: str
    fence: int = 0
    breakpoints: tuple[int, ...] = ()
    summaries_made: tuple[str, ...] = ()
    degraded: tuple[str, ...] = ()
    layers_fired: tuple[str, ...] = ()
    evicted: int = 0
    repairs: int = 0
    factor: float = 1.0


class Calibrate(msgspec.Struct, frozen=True, kw_only=True):
    """The provider reported ``reported`` input tokens for an assembly of ``estimated``
    sent with ``overhead`` more (the uncalibrated estimate of the agent's system text and
    tool declarations: the provider counts them too). ``factor`` is the one the assembly
    was counted at (``Assembled.factor``; None: the one in force when the report comes,
    which other reports of the model's calls in flight may have moved meanwhile)."""

    profile: ModelProfile
    estimated: int
    reported: int
    overhead: int = 0
    factor: float | None = None


class SearchContext(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    tenant: str | None
    query: str
    limit: int = 10


class InspectContext(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    tenant: str | None
    summary_id: str


class ExpandContext(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    tenant: str | None
    target: str
    max_tokens: int | None = None
    after: str | None = None
    offset: int = 0


def ask_context(ref: Any, message: object, timeout: float) -> Any:
    """Ask the ContextStore and wait, within ``timeout`` seconds in all, for the answer
    (a session's message is answered by its lane; see the module's docs). The engine's
    refusal (:class:`~stalwart.context.ContextScopeError`) and store errors are raised
    here; ``pykka.Timeout`` when the time runs out."""
    return answer(ref, message, timeout)


class _OffTheLock:
    """The pipeline engines' summarizer: the lane lets go of the store's lock while it
    runs (the DAG engine, which times its calls, is given the lock's ``open`` instead)."""

    __slots__ = ("_summarizer", "_turnstile")

    def __init__(self, summarizer: Summarizer, turnstile: Turnstile) -> None:
        self._summarizer = summarizer
        self._turnstile = turnstile

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        with self._turnstile.open():
            return self._summarizer(request)


def to_provider_messages(messages: Sequence[ContextMessage]) -> tuple[Message, ...]:
    """The provider-neutral shape of assembled messages."""
    return tuple(
        Message(
            role=message.role,
            content=message.content,
            tool_calls=message.tool_calls,
            tool_call_id=message.tool_call_id,
            images=message.images,
        )
        for message in messages
    )


class ContextStoreActor(Supervised):
    """Owns every ``context:<session>`` stream. Start with ``ContextStoreActor.start(
    store=..., clock=..., summarizer=..., settings=ContextEngineSettings())``.

    At most ``max_sessions`` sessions are kept in memory (the least recently used that
    have no work in flight go, and are rebuilt from the log on their next call).

    Messages: :class:`Assemble` (answered with :class:`Assembled`), :class:`SearchContext`,
    :class:`InspectContext`, :class:`ExpandContext` (answered with the engine's answer;
    dag mode): the reply is the session lane's future, which :func:`ask_context` waits
    for. :class:`Calibrate` (a lane of its own; its future gives the new ratio). A store
    error or an append conflict is raised to the asker and the session is rebuilt from
    the log on its next call.
    """

    def __init__(
        self,
        *,
        store: EventStore,
        clock: Clock,
        summarizer: Summarizer,
        settings: ContextEngineSettings | None = None,
        on_crash: Callable[[str], object] | None = None,
        max_sessions: int = 256,
        file_reader: FileReader | None = None,
    ) -> None:
        super().__init__()
        #: the pipeline engine's reader for layer 9 (None: it re-reads nothing)
        self._file_reader = file_reader
        self._max_sessions = max(1, max_sessions)
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._store = store
        self._clock = clock
        self._settings = settings or ContextEngineSettings()
        self._on_crash = on_crash
        #: held by the lane that works on the engines; let go while a summarizer runs
        self._turnstile = Turnstile()
        self._summarizer = _OffTheLock(summarizer, self._turnstile)
        self._lanes: Lanes | None = None
        #: the tenants' summarizer governors, shared by every worker on the store
        self._ledger = StoreLedger(
            store, clock, lease_ms=self._settings.summarizer_spend.reservation_lease_ms
        )
        self._dag = DagEngine(
            self._settings,
            summarizer=summarizer,
            clock=clock,
            outside=self._turnstile.open,
            ledger=self._ledger,
        )
        self._pipelines: dict[str, PipelineEngine] = {}
        self._pipeline_config = parse_pipeline(self._settings.pipeline)
        self._versions: dict[str, int] = {}
        #: per (provider, model): the version of its calibration stream folded in
        self._calibrations: dict[tuple[str, str], int] = {}
        #: per (provider, model): the factor its newest calibration record holds
        self._recorded_factors: dict[tuple[str, str], float] = {}

    @property
    def mode(self) -> str:
        return self._settings.version

    def started(self) -> None:
        self._lanes = Lanes(self._settings.parallel_sessions, name="stalwart-context")
        log.info("context_store.started", engine=self.mode)

    def on_stop(self) -> None:
        if self._lanes is not None:
            self._lanes.close()

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        from ._restarts import crashed  # noqa: PLC0415 (_restarts imports the actors)

        if self._lanes is not None:
            self._lanes.close()
        # its inbox closed: an ask put after pykka emptied it would wait out its timeout
        # (90 s for an assembly) unread; refused now, the gate asks the restarted engine
        self.take_inbox()
        crashed(self._on_crash, (exception_type, exception_value, traceback))

    def on_receive(self, message: Any) -> Any:
        match message:
            case Assemble() | SearchContext() | InspectContext() | ExpandContext():
                assert self._lanes is not None  # started
                return self._lanes.submit(message.session_id, partial(self._in_lane, message))
            case Calibrate():  # the estimators are the engine's: in a lane of their own
                assert self._lanes is not None
                return self._lanes.submit(_CALIBRATION, partial(self._calibrate, message))
            case _:
                raise TypeError(f"ContextStoreActor does not understand {type(message).__name__}")

    def _calibrate(self, message: Calibrate) -> float:
        """One more report of the provider's count. Each of the first
        :data:`CALIBRATION_WARM_UP` reports, and one that moves the factor by
        :data:`CALIBRATION_MOVE` or more from the factor last recorded, is recorded in the
        model's calibration stream, with its version expected, before the estimator takes
        it (another worker's report came first: fold it, and compute again); the others
        move the estimator in memory only (a steady model would otherwise cost a durable
        append per answered call). The calibration lane is serial, so nothing else moves
        the estimator between the two."""
        profile = message.profile
        key = (profile.provider, profile.model)
        stream = calibration_stream(profile)
        estimator = self._dag.estimator(profile)
        if stream is None:
            with self._turnstile:
                return self._dag.calibrate(
                    profile,
                    message.estimated,
                    message.reported,
                    overhead=message.overhead,
                    factor=message.factor,
                )
        for _ in range(APPEND_TRIES):
            with self._turnstile:
                self._calibration_taken(profile)
                raw = self._dag.raw_estimate(
                    profile, message.estimated, message.overhead, factor=message.factor
                )
                factor, observations = estimator.after(raw, message.reported)
                if observations == estimator.observations:
                    return factor  # a report that says nothing
                recorded_factor = self._recorded_factors.get(key)
                if (
                    observations > CALIBRATION_WARM_UP
                    and recorded_factor is not None
                    and abs(factor - recorded_factor) < CALIBRATION_MOVE * recorded_factor
                ):
                    estimator.factor, estimator.observations = factor, observations
                    return factor
            report = ContextCalibrated(
                provider=profile.provider,
                model=profile.model,
                estimated=raw,
                reported=message.reported,
                factor=factor,
                observations=observations,
            )
            try:
                recorded = self._store.append(
                    stream, [report], expected_version=self._calibrations[key]
                )
            except ConcurrencyError:
                continue  # another worker's report came first: taken in on the next try
            except StoreError as exc:  # a hint: the next answered call brings another
                log.warning("context.calibration_unrecorded", error=type(exc).__name__)
                return estimator.factor
            with self._turnstile:
                estimator.factor, estimator.observations = factor, observations
                self._calibrations[key] = recorded[-1].version
                self._recorded_factors[key] = factor
            return factor
        log.warning("context.calibration_contended", stream=stream)
        return estimator.factor

    def _calibration_taken(self, profile: ModelProfile) -> None:
        """Set the model's estimator from the newest record of its calibration stream when
        the stream moved since this run last looked (under the turnstile; one version
        read): a restarted process counts as the one before it did, and every worker on
        the store with the fold of every report, whichever worker took it in."""
        key = (profile.provider, profile.model)
        stream = calibration_stream(profile)
        if stream is None:
            return
        version = self._store.stream_version(stream)
        if version == self._calibrations.get(key):
            return
        if version:
            try:
                newest = next(iter(self._store.read_stream(stream, version)), None)
            except CorruptRecordError:
                newest = None
                log.error("context.calibration_unreadable", stream=stream, version=version)
            if newest is not None and isinstance(newest.event, ContextCalibrated):
                estimator = self._dag.estimator(profile)
                estimator.factor = newest.event.factor
                estimator.observations = newest.event.observations
                self._recorded_factors[key] = newest.event.factor
        self._calibrations[key] = version

    def _in_lane(self, message: Assemble | SearchContext | InspectContext | ExpandContext) -> Any:
        with self._turnstile:
            self._touch(message.session_id)
            return self._handle(message)

    def _handle(self, message: Assemble | SearchContext | InspectContext | ExpandContext) -> Any:
        match message:
            case Assemble():
                return self._assemble(message)
            case SearchContext():
                self._load(message.session_id)
                self._indexed(message.session_id)
                return self._dag.search(
                    message.session_id, message.query, tenant=message.tenant, limit=message.limit
                )
            case InspectContext():
                self._load(message.session_id)
                return self._dag.inspect(
                    message.session_id, message.summary_id, tenant=message.tenant
                )
            case ExpandContext():
                self._load(message.session_id)
                return self._dag.expand(
                    message.session_id,
                    message.target,
                    tenant=message.tenant,
                    max_tokens=message.max_tokens,
                    after=message.after,
                    offset=message.offset,
                )

    # -- assembly -------------------------------------------------------------------------

    def _assemble(self, message: Assemble) -> Assembled:
        if self.mode == "pipeline":
            return self._pipeline(message)
        session_id = message.session_id
        self._calibration_taken(message.profile)
        try:
            self._catch_up(session_id)
            if valid_session_id(session_id) and session_id not in self._dag.sessions:
                self._restore_for(message)
            if self._dag.relevance_first(message.profile):  # it ranks with the index
                self._indexed(session_id)
            result = self._dag.assemble(
                session_id,
                message.messages,
                message.budget,
                tenant=message.tenant,
                profile=message.profile,
                overhead=message.overhead,
            )
        except ContextScopeError as exc:
            self._refused(message, exc)
            raise
        except Exception:
            # a store error mid-assembly (the tenant's ledger): what the engine changed
            # in memory was not recorded, so the next call rebuilds the session from the log
            self._forget(session_id)
            raise
        try:
            self._append(f"context:{session_id}", result.events, epoch=message.epoch)
        except Exception:
            # what the engine decided is not in the log: forget it, so the next call
            # rebuilds the session from what is (the summarizer calls it made are in
            # their tenant's ledger already: what they spent was spent)
            self._forget(session_id)
            raise
        return Assembled(
            messages=to_provider_messages(result.messages),
            tokens=result.tokens,
            budget=result.budget,
            engine="dag",
            fence=result.fence,
            breakpoints=result.breakpoints,
            summaries_made=result.summaries_made,
            degraded=result.degraded,
            layers_fired=result.layers_fired,
            evicted=result.evicted,
            repairs=result.repairs,
            factor=result.factor,
        )

    def _refused(self, message: Assemble, exc: ContextScopeError) -> None:
        """Record an assembly refused for its scope: in the session's ``context:`` stream,
        or the refusals stream when the id names no session."""
        session_id = message.session_id
        stream = f"context:{session_id}" if valid_session_id(session_id) else None
        refusal = exc.events or (
            ContextDagDegraded(
                reason="fail_closed_rollover", tenant=message.tenant, session=session_id
            ),
        )
        self._append(
            stream or REFUSALS_STREAM,
            refusal,
            versioned=stream is not None,
            epoch=message.epoch if stream is not None else None,
        )

    def _pipeline(self, message: Assemble) -> Assembled:
        session_id = message.session_id
        if not valid_session_id(session_id):
            error = ContextScopeError("the session id is malformed")
            self._refused(message, error)
            raise error
        stream = f"context:{session_id}"
        self._catch_up(session_id)
        self._calibration_taken(message.profile)
        engine = self._pipelines.get(session_id)
        if engine is None:
            # from the fold's snapshot; its version is what the fold read (the stream's
            # version read after it could count a record another writer appended since)
            state = load_state(self._store, stream, CONTEXT_PIPELINE)
            engine = PipelineEngine(
                self._pipeline_config,
                summarizer=self._summarizer,
                reader=self._file_reader,
                clock=self._clock,
                session=session_id,
                state=state,
            )
            self._pipelines[session_id] = engine
            self._versions[session_id] = state.version
        estimator = self._dag.estimator(message.profile)
        try:
            result = engine.assemble(
                message.messages,
                message.budget,
                provider=message.profile.provider,
                caching=message.profile.caching,
                # the model's estimator, which Calibrate feeds with the usage reported
                estimator=estimator,
                overhead=message.overhead,
                tenant=message.tenant,
            )
        except ContextScopeError as exc:
            self._refused(message, exc)
            raise
        # what the result was counted at: the lane holds the lock from the count on
        factor = estimator.factor
        # the layer breaker decided at the assembly's clock reading: its events say so
        # (replay re-derives a breaker's cooldown from the time its event records)
        events = [
            NewEvent(event=event, ts=result.now) if isinstance(event, _BREAKER_EVENTS) else event
            for event in result.events
        ]
        try:
            self._append(stream, events, epoch=message.epoch)
        except Exception:
            self._forget(session_id)  # as in dag mode: rebuilt from the log next time
            raise
        return Assembled(
            messages=result.provider_messages(Message),
            tokens=result.tokens_out,
            budget=result.budget,
            engine="pipeline",
            fence=result.fence,
            breakpoints=result.breakpoints,
            layers_fired=result.layers_fired,
            repairs=result.repairs,
            factor=factor,
        )

    def _touch(self, session_id: str) -> None:
        """Keep the ``max_sessions`` most recently used sessions in memory (and any with
        work in flight); the others are rebuilt from the log when they are next used."""
        self._recent[session_id] = None
        self._recent.move_to_end(session_id)
        excess = len(self._recent) - self._max_sessions
        if excess <= 0:
            return
        lanes = self._lanes
        for idle in list(self._recent):  # the least recently used first
            if excess <= 0:
                break
            if idle == session_id or (lanes is not None and lanes.busy(idle)):
                continue  # its lane works on it: dropping it now would only cost a rebuild
            del self._recent[idle]
            self._forget(idle)
            excess -= 1

    def _catch_up(self, session_id: str) -> None:
        """Forget a session held in memory whose ``context:`` stream another writer moved
        on (a worker that served it meanwhile compacted it): it is rebuilt from the log,
        instead of appending behind that writer's summaries and failing the turn with a
        conflict. One stream-version read per use of a held session."""
        held = self._versions.get(session_id)
        if held is not None and self._store.stream_version(f"context:{session_id}") != held:
            log.info("context.session_moved_on", session=session_id, held_version=held)
            self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        """Drop what this run holds of a session; its next call rebuilds it from the log."""
        self._dag.sessions.pop(session_id, None)
        self._pipelines.pop(session_id, None)
        self._versions.pop(session_id, None)

    # -- the log ------------------------------------------------------------------------

    def _restore(self, session_id: str, messages: Sequence[ContextMessage]) -> None:
        """Rebuild a session's DAG from its ``context:`` stream: from the fold's newest
        snapshot and the records after it, not one record per model call ever made."""
        state = self._folded(session_id)
        if state.version:
            self._dag.restore_state(session_id, state, messages)

    def _restore_for(self, message: Assemble) -> None:
        """Rebuild a session for an assembly, with the asker's messages only when the
        session is the asker's tenant's: the messages of a write that is refused must not
        stay in memory, where the session's own next turn would take them in as its
        history (ContextScopeError, with nothing kept, otherwise)."""
        state = self._folded(message.session_id)
        if state.bound and state.tenant != message.tenant:
            log.warning(
                "context_write_refused", reason="fail_closed_rollover", tenant=message.tenant
            )
            raise ContextScopeError("the session belongs to another tenant")
        if state.version:
            self._dag.restore_state(message.session_id, state, message.messages)

    def _folded(self, session_id: str) -> ContextDagState:
        """The session's DAG fold (from its newest snapshot), and its version noted."""
        state = load_state(self._store, f"context:{session_id}", CONTEXT_DAG)
        self._versions[session_id] = state.version  # what the fold read: appends expect it
        return state

    def _indexed(self, session_id: str) -> None:
        """Build a held session's full-text index, when it has none yet, outside the
        store's lock: it takes about 90 µs a message (9 s for 100,000, the first search
        after a restart), and every other session's assembly waited for it. Only this
        session's lane changes the session meanwhile (a session with work in flight is
        never dropped), and what it stored since is indexed when the index is kept."""
        session = self._dag.sessions.get(session_id)
        if session is None or session.indexed:
            return
        with self._turnstile.open():
            index = session.build_index()
        session.take_index(index)

    def _load(self, session_id: str) -> None:
        """Rebuild a session for recall from the log alone (its messages are the Agent's
        fold of its ``session:`` stream, from that fold's snapshot) when this run has not
        assembled it yet."""
        if not valid_session_id(session_id):
            return
        self._catch_up(session_id)
        if session_id in self._dag.sessions:
            return
        view = load_state(self._store, f"session:{session_id}", AGENT_VIEW)
        self._restore(session_id, view.messages)

    def _append(
        self,
        stream: str,
        events: Sequence[Event | NewEvent],
        *,
        versioned: bool = True,
        epoch: int | None = None,
    ) -> None:
        if not events:
            return
        session_id = stream.removeprefix("context:")
        expected = self._versions.get(session_id) if versioned else None
        if versioned and expected is None:
            expected = self._store.stream_version(stream)
        fence = None
        if epoch is not None:
            # the first append of a newer lease claims its epoch on the context stream
            # too; the store checks it atomically, so a holder the lease left is refused
            fence = Fence(epoch, claim=epoch > self._store.lease_epoch(stream))
        recorded = self._store.append(stream, list(events), expected_version=expected, fence=fence)
        if versioned and recorded:
            self._versions[session_id] = recorded[-1].version


_BREAKER_EVENTS = (ContextLayerDisabled, ContextLayerHalfOpened, ContextLayerEnabled)
#: how many times a calibration is computed again after another worker's came first
APPEND_TRIES = 5
#: the streams of the models' calibrations: ``context-calibration:<provider>:<model>``
CALIBRATION_STREAM = "context-calibration"
#: every one of a model's first reports is recorded (they move its factor the most)
CALIBRATION_WARM_UP = 10
#: later, a report is recorded when it moves the factor by this share of the recorded one
CALIBRATION_MOVE = 0.02


def calibration_stream(profile: ModelProfile) -> str | None:
    """The stream of ``profile``'s model's token-estimate calibration; None for a model
    whose name no stream id can hold (its calibration then lives in memory only)."""
    stream = f"{CALIBRATION_STREAM}:{profile.provider}:{profile.model}"
    try:
        check_stream(stream)
    except InvalidStreamError:
        return None
    return stream
