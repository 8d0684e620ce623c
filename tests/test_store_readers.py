"""Many readers at once wait for a read slot instead of failing (a thousand actors may read)."""

from __future__ import annotations

import threading
from pathlib import Path

from stalwart import store as store_module
from stalwart.events import MessageAppended

THREADS = 600


def test_hundreds_of_threads_reading_at_once_all_succeed(tmp_path: Path) -> None:
    log = store_module.open(tmp_path / "store")
    try:
        for n in range(20):
            log.append(f"session:{n}", [MessageAppended(message_id="m", role="user")] * 50)
        start = threading.Barrier(THREADS)
        errors: list[BaseException] = []
        counts: list[int] = []

        def read(n: int) -> None:
            start.wait()
            try:
                counts.append(sum(1 for _ in log.read_stream(f"session:{n % 20}")))
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=read, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        log.close()
    assert errors == []
    assert counts == [50] * THREADS
