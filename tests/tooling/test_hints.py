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
