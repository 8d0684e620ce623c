"""The base of every event, the unknown-event placeholder and the recorded envelope."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

Severity = Literal["debug", "info", "warning", "error"]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """Base of every event: a frozen msgspec Struct with an explicit ``domain:name`` tag.

    Subclasses declare ``tag="domain:name"``; the tag is the wire name and never changes.
    ``schema_version`` grows when a payload changes incompatibly; an upcaster then turns
    older payloads into the current shape on read. Events accept unknown fields, so a
    payload written by a newer version with extra fields still decodes.

    Events are immutable values that cannot form reference cycles, so they are not
    tracked by the cyclic garbage collector (``gc=False``): replaying millions of them
    does not trigger collections.
    """

    schema_version: ClassVar[int] = 1
    severity: ClassVar[Severity] = "info"


class UnknownEvent(Event, frozen=True, tag="stalwart:unknown"):
    """An event whose tag this version does not know: kept with its raw bytes, never dropped.

    It is what reading returns for a record written by a newer stalwart (or a plugin this
    process does not load). It cannot be appended: stalwart only writes events it knows.
    """

    tag: str
    schema: int
    raw: bytes
    severity: ClassVar[Severity] = "warning"
