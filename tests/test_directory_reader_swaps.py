"""``directory_reader`` against a path swapped while it reads: the model names the path,
and whatever else runs on the host can change what is there between the reader's check
and its open. A swapped-in link must not read outside the root, and a swapped-in FIFO
must not hang the ContextStore's lane."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from stalwart.context.pipeline import directory_reader

INSIDE = "inside the root"
OUTSIDE = "a secret outside the root"


def _swapper(path: Path, kinds: list[str], stop: threading.Event) -> threading.Thread:
    """Swaps ``path`` between the given kinds (a regular file, a link out, a FIFO) as
    fast as it can, each by an atomic rename, until ``stop``."""
    staging = path.with_name(path.name + ".next")

    def make(kind: str) -> None:
        if kind == "file":
            staging.write_text(INSIDE)
        elif kind == "link":
            staging.symlink_to(path.parent.parent / "outside.txt")
        else:
            os.mkfifo(staging)

    def run() -> None:
        n = 0
        while not stop.is_set():
            make(kinds[n % len(kinds)])
            os.replace(staging, path)
            n += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _read_while_swapping(tmp_path: Path, kinds: list[str], reads: int) -> set[str | None]:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside.txt").write_text(OUTSIDE)
    (root / "notes.txt").write_text(INSIDE)
    read = directory_reader(root)
    stop = threading.Event()
    swapper = _swapper(root / "notes.txt", kinds, stop)
    seen: set[str | None] = set()
    done = threading.Event()

    def reader() -> None:
        for _ in range(reads):
            seen.add(read("notes.txt"))
        done.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    finished = done.wait(30.0)  # real-time: a reader stuck on a FIFO never finishes
    stop.set()
    swapper.join(5.0)
    if not finished:
        # let a reader blocked in open() on the FIFO go (a writer end unblocks it)
        fifo = root / "notes.txt"
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert finished, "a read hung on a FIFO swapped in after the check"
    return seen


# Was: DEFECT: directory_reader checked the path was a regular file, then opened it: a
# FIFO renamed over it in between made the open wait for a writer, for ever, holding the
# session's ContextStore lane.
def test_a_fifo_swapped_in_reads_as_missing_instead_of_hanging(tmp_path: Path) -> None:
    seen = _read_while_swapping(tmp_path, ["file", "fifo"], reads=8_000)
    assert seen <= {INSIDE, None}


# Was: DEFECT: a link out of the root renamed over a checked file was followed by the
# open: the reader returned what lies outside the root.
def test_a_link_swapped_in_never_reads_outside_the_root(tmp_path: Path) -> None:
    seen = _read_while_swapping(tmp_path, ["file", "link"], reads=8_000)
    assert OUTSIDE not in seen
    assert seen <= {INSIDE, None}


def test_a_fifo_and_a_directory_read_as_missing(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("nested")
    read = directory_reader(tmp_path)
    assert read("pipe") is None
    assert read("dir") is None
    assert read(".") is None
    assert read("dir/a.txt") == "nested"
    assert read(str(tmp_path / "dir" / "a.txt")) == "nested"


def test_a_link_inside_the_root_is_still_read(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.txt").write_text("through a link")
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    (tmp_path / "b.txt").symlink_to(tmp_path / "real" / "a.txt")
    read = directory_reader(tmp_path)
    assert read("alias/a.txt") == "through a link"
    assert read("b.txt") == "through a link"
