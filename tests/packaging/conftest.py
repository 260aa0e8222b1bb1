from __future__ import annotations

from pathlib import Path

import pytest

from lmstool.matrix import Matrix, load_matrix

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def repo() -> Path:
    return REPO


@pytest.fixture()
def matrix() -> Matrix:
    return load_matrix(REPO)
