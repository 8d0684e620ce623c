"""A store path with a NUL in it (a config's ``store.location = "a\\u0000b"``) is a typed
StoreError, and one line with exit 1 in the CLI, not ``internal error (a bug)``."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.errors import StoreError


# Was: DEFECT: open("a\x00b") raised a bare ValueError from deep in os/lmdb.
def test_a_path_with_a_nul_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="NUL"):
        store_module.open("a\x00b")
    with pytest.raises(StoreError, match="NUL"):
        store_module.open("a\x00b", create=False, read_only=True)


def test_the_cli_says_it_in_one_line() -> None:
    result = CliRunner().invoke(cli, ["--store", "a\x00b", "streams"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "NUL" in result.stderr
    assert "internal error" not in result.stderr
