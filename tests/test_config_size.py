"""A config path that names a device or a huge file is refused, not read whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.config import MAX_DOCUMENT_BYTES, load_config
from stalwart.errors import ConfigError
from tests.test_cli_review import assert_one_error_line, stalwart


# Was: DEFECT: `stalwart run --config /dev/zero hi` read without end, memory growing until the process was killed  # noqa: E501
def test_a_config_that_never_ends_is_one_error_line() -> None:
    code, _, err = stalwart("run", "--config", "/dev/zero", "hi", timeout=60)
    assert_one_error_line(code, err)
    assert "larger than 16 MiB" in err


def test_a_config_just_over_the_limit_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * MAX_DOCUMENT_BYTES + b"\n")
    with pytest.raises(ConfigError, match="larger than"):
        load_config(big)
