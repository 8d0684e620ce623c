"""The pipeline engine's knobs, with the seed's defaults, and the names of its ten layers."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from stalwart.errors import ConfigError

__all__ = ["LAYERS", "ObservationTier", "PipelineConfig", "parse_pipeline"]

ObservationTier = Literal["protected", "standard", "ephemeral"]

#: a count of turns, messages, characters or tokens that may be 0 (the layer keeps none)
_Count = Annotated[int, msgspec.Meta(ge=0)]
#: one that must be at least 1 (0 would drop the newest turn, or disable the layer)
_AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]

#: The ten layers, in the order they run (the names events and logs use).
LAYERS: tuple[str, ...] = (
    "thinking_cleaner",
    "signature_scrubber",
    "surrogate_guard",
    "reasoning_tag_stripper",
    "history_window",
    "dead_content_evictor",
    "observation_masker",
    "compaction",
    "rehydration",
    "objective_reinforcement",
)


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The pipeline engine's config. The first nine knobs are the seed's
    (``thinkingKeepTurns`` ... ``compactionPrefixAnchorTurns`` and the 85% threshold);
    the rest are ours, documented in ``docs/context-pipeline.md``."""

    thinking_keep_turns: _Count = 10
    history_turns: _AtLeastOne = 15
    eviction_min_age: _Count = 15
    observation_keep_window: _Count = 25
    observation_trigger_chars: _Count = 120_000
    ephemeral_keep_window: _Count = 10
    compaction_cooldown_turns: _Count = 5
    compaction_prefix_anchor_turns: _Count = 2
    #: a fraction of the budget (0.85, not 85)
    compaction_threshold: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.85
    #: the newest user turns compaction keeps verbatim (fewer if they alone pass the
    #: threshold; never fewer than one)
    compaction_tail_turns: _AtLeastOne = 10
    #: the most a summary may be, in tokens
    summary_max_tokens: _AtLeastOne = 2_000
    #: the observation tier of each tool by name; unnamed tools are ``default_tier``
    observation_tiers: dict[str, ObservationTier] = msgspec.field(default_factory=dict)
    default_tier: ObservationTier = "standard"
    #: the agent's instructions file, read through the engine's reader after compaction
    instructions_file: str | None = "AGENTS.md"
    rehydrate_max_files: _Count = 5
    rehydrate_max_chars: _Count = 8_000
    #: on a caching provider, how many user turns the cache fence holds what was sent
    #: before it unchanged before the layers shape it again (0: no fence)
    cache_fence_turns: _Count = 5
    #: consecutive failures that disable a layer, and how long until its half-open trial
    layer_failure_limit: _AtLeastOne = 3
    layer_retry_after_s: Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0 * 365)] = 600.0


def parse_pipeline(knobs: dict[str, Any]) -> PipelineConfig:
    """The pipeline engine's config from ``context_engine.pipeline``; ConfigError naming
    the key when it is not one of ``PipelineConfig``'s, or out of shape."""
    try:
        return msgspec.convert(knobs, PipelineConfig)
    except msgspec.ValidationError as exc:
        at = re.search(r"at `\$\.(\w+)", str(exc))  # the knob msgspec names, if any
        key = "context_engine.pipeline" + (f".{at.group(1)}" if at else "")
        raise ConfigError(f"key {key!r}: {exc}", key=key) from None
