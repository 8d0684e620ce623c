"""The log's records after the index mark: how the writer learns them, and what it tells
this process's readers about them.

The index trails the log (see ``_environment``), so the records after its mark are found
by their heads: each stored record begins with its position, stream and version. The
writer keeps those three for every record after the mark, the ones it appended and the
ones it read back after another process appended, and publishes them as a
:class:`LogTail` that readers in this process use instead of scanning the log.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

#: a record after the mark, as the writer knows it: (stream key, version, position)
Entry = tuple[bytes, int, int]


class _Head(msgspec.Struct, array_like=True, gc=False):
    """The first fields of a stored record: enough to index it without decoding it."""

    position: int
    stream: str
    version: int


#: the head of a stored record (msgspec ignores the array's fields after the third)
HEAD = msgspec.msgpack.Decoder(_Head).decode


def read_heads(cursor: Any, after: int, upto: int) -> tuple[list[Entry], tuple[int, str] | None]:
    """The entries of the log's records ``after`` < position <= ``upto``, in order, as far
    as they can be read; and, if one cannot, its position and what is wrong with it."""
    entries: list[Entry] = []
    expected = after + 1
    if expected > upto or not cursor.set_range(expected.to_bytes(8, "big")):
        return entries, None if expected > upto else (expected, "missing from the log")
    for key, value in cursor.iternext():
        position = int.from_bytes(key, "big")
        if position > upto:
            break
        if position != expected:
            return entries, (expected, "missing from the log")
        try:
            head = HEAD(value)
        except msgspec.DecodeError as exc:
            return entries, (position, f"cannot decode the record: {exc}")
        if head.position != position:
            return entries, (position, f"the record says it is at {head.position}")
        entries.append((head.stream.encode("utf-8"), head.version, position))
        expected = position + 1
    if expected <= upto:
        return entries, (expected, "missing from the log")
    return entries, None


class LogTail:
    """Every record after the index mark ``indexed``, up to ``head``, by stream: what
    one commit of this process's writer left. Readers share it with the writer, which
    only ever adds to it (under the GIL, each list append is whole) and then moves
    ``head``; a reader trusts it for a transaction that saw the same mark and no record
    past ``head``."""

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

    def positions(self, key: bytes, first: int, last: int) -> list[int]:
        """The positions of the stream's versions ``first``..``last`` after the mark."""
        found = self.streams.get(key)
        if not found:
            return []
        start = max(first - found[0][0], 0)
        return [position for version, position in found[start:] if version <= last]
