"""The log's records after the index mark: how the writer learns them, and what it tells
this process's readers about them.

The index trails the log (see ``_environment``), so the records after its mark are found
by their heads: each stored record begins with its position, stream and version. The
writer keeps those three for every record after the mark, the ones it appended and the
ones it read back after another process appended, and publishes them as a
:class:`LogTail` that readers in this process use instead of scanning the log.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from stalwart.events import UNREADABLE

#: a record after the mark, as the writer knows it: (stream key, version, position)
Entry = tuple[bytes, int, int]


class _Head(msgspec.Struct, array_like=True, gc=False):
    """The first fields of a stored record: enough to index it without decoding it."""

    position: int
    stream: str
    version: int


#: the head of a stored record (msgspec ignores the array's fields after the third)
HEAD = msgspec.msgpack.Decoder(_Head).decode
#: one position of a scan: its record's bytes and head, or (bytes or None) what is wrong
Scanned = tuple[int, bytes | None, _Head | str]


def log_head(cursor: Any) -> int:
    """The position of the log's last record (0 for an empty log); moves ``cursor``."""
    return int.from_bytes(cursor.key(), "big") if cursor.last() else 0


def scan_heads(cursor: Any, after: int, upto: int) -> Iterator[Scanned]:
    """The log's positions ``after`` < position <= ``upto`` in order, each with its record's
    bytes and head, or what is wrong there instead: a record that cannot be read, or a
    position missing from the log (a run of them once, at its first)."""
    expected = after + 1
    if expected > upto:
        return
    if cursor.set_range(expected.to_bytes(8, "big")):
        for key, value in cursor.iternext():
            position = int.from_bytes(key, "big")
            if position > upto:
                break
            if position != expected:
                yield expected, None, "missing from the log"
            expected = position + 1
            try:
                head = HEAD(value)
            except UNREADABLE as exc:
                yield position, value, f"cannot decode the record: {exc}"
                continue
            if head.position != position:
                yield position, value, f"the record says it is at {head.position}"
                continue
            yield position, value, head
    if expected <= upto:
        yield expected, None, "missing from the log"


def read_heads(
    cursor: Any, after: int, upto: int, last: dict[bytes, int] | None = None
) -> tuple[list[Entry], tuple[int, str] | None]:
    """The entries of the log's records ``after`` < position <= ``upto``, in order, as far
    as they can be read; and, if one cannot, its position and what is wrong with it.

    A record whose head gives its stream a version that does not follow the stream's
    last one (in ``last``, each stream's version before ``after``, where known, or read
    here) cannot be read either: a stream's versions have no gaps and no repeats, so its
    head is damaged (it names another stream or version), or the record before it is.
    Taken as read, it would move every version a tail or the index finds after it."""
    entries: list[Entry] = []
    versions = {} if last is None else dict(last)
    for position, _, head in scan_heads(cursor, after, upto):
        if isinstance(head, str):
            return entries, (position, head)
        key = head.stream.encode("utf-8")
        before = versions.get(key)
        if before is not None and head.version != before + 1:
            reason = f"it holds version {head.version} of {head.stream!r}, {before + 1} was due"
            return entries, (position, reason)
        versions[key] = head.version
        entries.append((key, head.version, position))
    return entries, None


class LogTail:
    """Every record after the index mark ``indexed``, up to ``head``, by stream: what
    one commit of this process's writer left, or what a reader of this process read of
    the log's tail (see ``_Environment.tail_for``). The writer only ever adds to it
    (under the GIL, each list append is whole) and then moves ``head``; a reader trusts
    it for a transaction that saw the same mark and no record past ``head``."""

    __slots__ = ("head", "indexed", "streams")

    def __init__(self, indexed: int, head: int, entries: Iterable[Entry]) -> None:
        self.indexed = indexed
        self.head = indexed
        self.streams: dict[bytes, list[tuple[int, int]]] = {}
        self.add(entries, head)

    def add(self, entries: Iterable[Entry], head: int) -> None:
        streams = self.streams
        for key, version, position in entries:
            found = streams.get(key)
            if found is None:
                streams[key] = [(version, position)]
            else:
                found.append((version, position))
        self.head = head

    def copy(self) -> LogTail:
        """Another tail holding the same records (for a reader to extend)."""
        copied = LogTail(self.indexed, self.indexed, ())
        copied.streams = {key: list(found) for key, found in self.streams.items()}
        copied.head = self.head
        return copied

    def last_versions(self) -> dict[bytes, int]:
        """Each stream's last version in the tail."""
        return {key: found[-1][0] for key, found in self.streams.items() if found}

    def positions(self, key: bytes, first: int, last: int) -> list[int]:
        """The positions of the stream's versions ``first``..``last`` after the mark."""
        found = self.streams.get(key)
        if not found:
            return []
        start = max(first - found[0][0], 0)
        return [position for version, position in found[start:] if version <= last]
