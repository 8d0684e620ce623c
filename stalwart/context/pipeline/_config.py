"""The pipeline engine's knobs, with the seed's defaults, and the names of its ten layers."""

from __future__ import annotations

# the knobs are checked with the rest of the config, so they are defined beside it
from stalwart.config import ObservationTier, PipelineConfig, parse_pipeline

__all__ = ["LAYERS", "ObservationTier", "PipelineConfig", "parse_pipeline"]

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
