"""A load that folds past a damaged record (``skip_unreadable``: the health actor's and
the runtime's breaker loads) saves no snapshot: one saved past the damage would let a
later load that does not skip (``stalwart replay provider:X``) fold past it in silence,
where without the snapshot it raises ``CorruptRecordError``."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.errors import CorruptRecordError
from stalwart.state import SESSION
from stalwart.store import load_state, snapshot_name
from tests.store_contract import msg
from tests.test_store_index_lag import damage


# Was: DEFECT: a skipping load saved a snapshot past a damaged record; a later load that
# does not skip started from it and never met the damage.
def test_a_load_that_skipped_a_damaged_record_saves_no_snapshot(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("session:s", [msg(n) for n in range(30)])
    damage(store_dir, 5, None)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        skipped = load_state(store, "session:s", SESSION, snapshot_every=10, skip_unreadable=True)
        assert skipped.version == 30
        assert list(store.snapshots("session:s", snapshot_name(SESSION))) == []
        with pytest.raises(CorruptRecordError):
            load_state(store, "session:s", SESSION, snapshot_every=10)


def test_a_load_that_skipped_nothing_still_saves_its_snapshot(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("session:s", [msg(n) for n in range(30)])
        load_state(store, "session:s", SESSION, snapshot_every=10, skip_unreadable=True)
        (snapshot,) = store.snapshots("session:s", snapshot_name(SESSION))
        assert snapshot.version == 30
