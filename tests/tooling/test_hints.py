"""lmstool.hints: what an error tells the user to type, run directly or under make."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmstool.hints import command, make_command, option
from lmstool.series import fresh_checkout


def test_direct_calls_name_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMSTOOL_FRONTEND", raising=False)
    monkeypatch.setenv("LMSTOOL_MAKE_VARS", "SOURCES=../t")  # ignored outside make
    assert option("sources", "DIR") == "--sources DIR"
    assert command("lmstool patches v2.6.0", "make patches TAG=v2.6.0") == (
        "`lmstool patches v2.6.0`"
    )
    assert make_command("make patches TAG=v2.6.0") == "make patches TAG=v2.6.0"


def test_make_commands_keep_the_users_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A suggested make command runs against the source and work area the user gave."""
    monkeypatch.setenv("LMSTOOL_FRONTEND", "make")
    monkeypatch.setenv("LMSTOOL_MAKE_VARS", "SOURCES=../tarballs WORK=/scratch")
    assert option("sources", "DIR") == "SOURCES=DIR"
    assert make_command("make patches TAG=v1.13.1") == (
        "make patches TAG=v1.13.1 SOURCES=../tarballs WORK=/scratch"
    )
    fix = fresh_checkout(Path("/scratch/pytorch-v2.6.0"), "v2.6.0")
    assert fix == (
        "`rm -rf /scratch/pytorch-v2.6.0 && make patch TAG=v2.6.0 SOURCES=../tarballs "
        "WORK=/scratch`"
    )
    monkeypatch.setenv("LMSTOOL_MAKE_VARS", "")
    assert make_command("make patches TAG=v1.13.1") == "make patches TAG=v1.13.1"


def test_channel_folder_error_names_channel_under_make(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`make channel` on a missing folder says that CHANNEL= names another."""
    from lmstool import conda
    from lmstool.errors import LmsToolError

    missing = tmp_path / "channel"
    monkeypatch.setenv("LMSTOOL_FRONTEND", "make")
    with pytest.raises(LmsToolError, match="or index another with CHANNEL=DIR"):
        conda.index_channel(missing)
    monkeypatch.delenv("LMSTOOL_FRONTEND")
    with pytest.raises(LmsToolError) as raised:
        conda.index_channel(missing)
    assert "CHANNEL" not in str(raised.value)
