"""The pipeline context engine (``context_engine.version = "pipeline"``): ten layers in a
fixed order reshape a session's transcript before every provider call.

The stable entry point::

    engine = PipelineEngine(
        PipelineConfig(),          # the seed's defaults; see docs/context-pipeline.md
        summarizer=summarizer,     # stalwart.context.Summarizer, used by layer 8 only
        clock=clock,               # stalwart.clock.Clock (breaker cooldowns)
        reader=read_file,          # optional: path -> text | None, for layer 9
        estimator=None,            # optional TokenEstimator; else one per provider
        session="s-1",             # optional, only for logs
    )
    result = engine.assemble(messages, budget_tokens, provider="openai")
    result.messages                # tuple[ContextMessage, ...], provider-valid
    result.provider_messages(stalwart.providers.Message)   # the provider shape
    result.events                  # append to "context:<session id>", in order
    engine = PipelineEngine.from_events(recorded, config, summarizer=..., clock=...)

One engine serves one session. ``messages`` is the session's whole stored transcript in
order (:class:`stalwart.context.ContextMessage`); ``provider`` is the provider's API
family (``"anthropic"`` or another, which decides layer 4 and the token profile). The
layers (names as events and logs give them):

1. ``thinking_cleaner``: thinking blocks only on the newest 10 user turns.
2. ``signature_scrubber``: in a cache-break replay, thinking signatures are dropped
   (and redacted blocks). A run is a replay when an earlier assembly exists and the
   provider changed, or this input does not extend the previous input (see
   :func:`is_replay`): the history was rewritten, so nothing is served from cache.
3. ``surrogate_guard``: lone UTF-16 surrogate halves become U+FFFD in text, tool
   arguments and thinking.
4. ``reasoning_tag_stripper``: ``<think>``-style tags cut out of assistant text
   (providers other than Anthropic).
5. ``history_window``: the newest 15 user turns (and the leading system messages).
6. ``dead_content_evictor``: an older call + result superseded by a newer identical
   call with a result, once 15 messages old.
7. ``observation_masker``: over 120,000 characters, standard results older than the 25
   newest are masked, ephemeral ones older than the 10 newest removed with their call.
8. ``compaction``: at 85% of the budget, the middle (after 2 anchor turns, before the
   newest turns) becomes one summary message, at most every 5 user turns unless the
   transcript is over the budget itself; it stays in force on later runs.
9. ``rehydration``: after compaction, the instructions file and the files summarized
   tool calls referenced, read through ``reader``, within the room the budget leaves.
10. ``objective_reinforcement``: the session's first user message, restated when it is
    no longer in the transcript.

On a caching provider (``assemble(..., caching=True)``, the default) a cache fence
keeps what the previous call sent unchanged at the front of the next request; the
layers' output counts for the messages added since, and what the fence holds is shaped
again every ``cache_fence_turns`` (5) user turns or for a recorded reason
(``result.cache_break``; see ``_fence``).

A layer that raises is skipped for that run; after 3 failures in a row it is disabled
(``context:layer_disabled``, a WARN) until its half-open trial 600 s later. The result
is provider-valid (pairs kept together; the DAG engine's ``repair`` as a last guarantee)
and fits the budget: when the newest turn alone is over it, its longest tool results are
cut to fit, marked (``result.clipped``), and when even their lines alone do not fit, its
oldest steps are left out, with the engine's line saying so (``result.steps_left_out``;
see ``_fit``). See ``docs/context-pipeline.md``.
"""

from ._config import LAYERS, ObservationTier, PipelineConfig, parse_pipeline
from ._engine import PipelineEngine, PipelineResult, is_replay
from ._reader import directory_reader
from ._run import FileReader
from ._wrap import safe_label, wrap_untrusted

__all__ = [
    "LAYERS",
    "FileReader",
    "ObservationTier",
    "PipelineConfig",
    "PipelineEngine",
    "PipelineResult",
    "directory_reader",
    "is_replay",
    "parse_pipeline",
    "safe_label",
    "wrap_untrusted",
]
