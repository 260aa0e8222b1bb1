"""The tag matrix: the real config/tags.yaml loads, and every kind of mistake is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from toolfakes import REPO_ROOT, run_cli

from lmstool.errors import LmsToolError
from lmstool.matrix import load_matrix


def test_real_matrix_loads() -> None:
    matrix = load_matrix(REPO_ROOT)
    assert matrix.default_tag in matrix.tags
    tag = matrix.get_tag("v2.6.0")
    assert tag.source.git_ref == "v2.6.0"
    assert tag.source.tarballs[0].top == "pytorch-v2.6.0"
    assert tag.source.tarballs[0].submodules is False
    assert len(tag.source.tarballs[0].sha256) == 64
    assert tag.series == Path("patches/v2.6.0")
    assert "3.11" in tag.python and "12.4" in tag.cuda["ppc64le"]


def test_unknown_tag_lists_supported_tags() -> None:
    matrix = load_matrix(REPO_ROOT)
    with pytest.raises(LmsToolError) as exc:
        matrix.get_tag("v9.9.9")
    supported = ", ".join(matrix.tags)
    assert f"unknown tag 'v9.9.9'; supported tags: {supported}" in str(exc.value)
    assert "v2.6.0, v1.13.1" in supported


def test_cli_unknown_tag_exits_2_with_message() -> None:
    for command in ("checkout", "apply", "export", "patches", "verify"):
        proc = run_cli(command, "v9.9.9")
        assert proc.returncode == 2, (command, proc.stderr)
        assert f"lmstool {command}: error: unknown tag 'v9.9.9'; supported tags:" in proc.stderr


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tags.yaml"
    path.write_text(text, encoding="utf-8")
    return path


GOOD = (REPO_ROOT / "config" / "tags.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tags: [unclosed\n", "not valid YAML"),
        ("- a list\n", "top level: expected a mapping"),
        (GOOD.replace("github_remote:", "#"), "missing key 'github_remote'"),
        (GOOD.replace("    version: 2.6.0\n", ""), "tags.v2.6.0: missing key 'version'"),
        (GOOD.replace("099a9601bc40", "zz"), "is not a 64-digit hex sha256"),
        (GOOD.replace("default_tag: v2.6.0", "default_tag: v3"), "'v3' is not one of the tags"),
        (
            GOOD.replace("          top: pytorch-v2.6.0\n", ""),
            "tags.v2.6.0.source.tarballs[0]: missing key 'top'",
        ),
    ],
)
def test_bad_matrix_names_the_problem(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(LmsToolError) as exc:
        load_matrix(path=path)
    assert expected in str(exc.value)
    assert str(path) in str(exc.value)


def test_missing_matrix(tmp_path: Path) -> None:
    with pytest.raises(LmsToolError, match="not found; run from a project checkout"):
        load_matrix(tmp_path)


def test_every_command_has_help() -> None:
    assert run_cli("--help").returncode == 0
    for command in ("checkout", "apply", "export", "patches", "verify"):
        proc = run_cli(command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert f"usage: lmstool {command}" in proc.stdout
