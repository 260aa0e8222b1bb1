"""Every tag with a series, from its real source tarball: the committed series applies with
`git am` to the pristine tag and equals a fresh generation from engine/ + integration/<tag>/.

The tags come from config/tags.yaml (lmstool.matrix); each one skips with a reason when its
tarball is not in $LMS_SOURCES (`make test SOURCES=DIR`). Slow: each tag's tarball is imported
once per session (v2.6.0: 15.5k files, about 20 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from toolfakes import REPO_ROOT, sources_dir

from lmstool.generate import Sources, verify_tag
from lmstool.matrix import load_matrix
from lmstool.series import series_files
from lmstool.source import SourceSpec

MATRIX = load_matrix(REPO_ROOT)
TAGS = [tag.name for tag in MATRIX.tags_with_series()]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lms-cache-tags")


def tag_sources(name: str) -> Path:
    """$LMS_SOURCES when it holds the tag's tarball; skips the test otherwise."""
    tarball = MATRIX.get_tag(name).source.tarballs[0].name
    sources = sources_dir()
    if sources is None or not (sources / tarball).is_file():
        pytest.skip(f"needs {tarball} for {name}: `make test SOURCES=DIR` (or $LMS_SOURCES)")
    return sources


def test_the_matrix_has_tags_with_a_series() -> None:
    assert MATRIX.default_tag in TAGS and len(TAGS) == len(set(TAGS))


@pytest.mark.parametrize("name", TAGS)
def test_committed_series_is_current(name: str, cache: Path) -> None:
    """patches/<tag>/ applies to the pristine tag and equals a fresh generation: CI fails when a
    series is stale or no longer applies."""
    sources = Sources(MATRIX, SourceSpec(sources=tag_sources(name), cache=cache), REPO_ROOT)
    tag = MATRIX.get_tag(name)
    report = verify_tag(sources, tag)
    assert report.ok, "\n".join(report.problems)
    assert f"committed series applies to pristine {name}" in report.notes
    assert series_files(tag.series_dir(REPO_ROOT)), f"{tag.series} holds no patches"
