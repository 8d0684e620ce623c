"""The pipeline engine's knobs, with the seed's defaults, and the names of its ten layers."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["LAYERS", "ObservationTier", "PipelineConfig"]

ObservationTier = Literal["protected", "standard", "ephemeral"]

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

    thinking_keep_turns: int = 10
    history_turns: int = 15
    eviction_min_age: int = 15
    observation_keep_window: int = 25
    observation_trigger_chars: int = 120_000
    ephemeral_keep_window: int = 10
    compaction_cooldown_turns: int = 5
    compaction_prefix_anchor_turns: int = 2
    compaction_threshold: float = 0.85
    #: the newest user turns compaction keeps verbatim (fewer if they alone pass the
    #: threshold; never fewer than one)
    compaction_tail_turns: int = 10
    #: the most a summary may be, in tokens
    summary_max_tokens: int = 2_000
    #: the observation tier of each tool by name; unnamed tools are ``default_tier``
    observation_tiers: dict[str, ObservationTier] = msgspec.field(default_factory=dict)
    default_tier: ObservationTier = "standard"
    #: the agent's instructions file, read through the engine's reader after compaction
    instructions_file: str | None = "AGENTS.md"
    rehydrate_max_files: int = 5
    rehydrate_max_chars: int = 8_000
    #: on a caching provider, how many user turns the cache fence holds what was sent
    #: before it unchanged before the layers shape it again (0: no fence)
    cache_fence_turns: int = 5
    #: consecutive failures that disable a layer, and how long until its half-open trial
    layer_failure_limit: int = 3
    layer_retry_after_s: float = 600.0
