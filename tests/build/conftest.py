from __future__ import annotations

from pathlib import Path

import pytest

from lmstool.build import BuildMatrix

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def repo() -> Path:
    return REPO


@pytest.fixture()
def matrix() -> BuildMatrix:
    return BuildMatrix.load(REPO)
