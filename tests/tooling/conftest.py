from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from toolfakes import FAKE_TAG, Fake, make_project

from lmstool.matrix import load_matrix


@pytest.fixture()
def fake(tmp_path: Path) -> Fake:
    project, sources = make_project(tmp_path)
    matrix = load_matrix(project)
    return Fake(project, sources, tmp_path / "cache", matrix, matrix.get_tag(FAKE_TAG))


@pytest.fixture()
def fake_tree(fake: Fake, tmp_path: Path) -> Iterator[Path]:
    yield fake.checkout(tmp_path / "tree")
