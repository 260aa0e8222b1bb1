"""The tag matrix: the real config/tags.yaml loads, and every kind of mistake is named."""

from __future__ import annotations

import shutil
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


def test_tags_lists_python_and_cuda_per_architecture() -> None:
    """`lmstool tags` shows what a build of each tag supports: Python and, per architecture,
    CUDA (config/tags.yaml)."""
    matrix = load_matrix(REPO_ROOT)
    proc = run_cli("tags")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(matrix.tags)
    for line, tag in zip(lines, matrix.tags.values()):
        assert line.startswith(
            f"{tag.name}{' (default)' if tag.name == matrix.default_tag else ''}:"
        )
        assert f"; Python {', '.join(tag.python)};" in line
        for arch, cudas in tag.cuda.items():
            assert f"on {arch}: {', '.join(cudas)}" in line
    first = matrix.get_tag("v2.6.0")
    assert f"CUDA on x86_64: {', '.join(first.cudas('x86_64'))}; on ppc64le: " in proc.stdout


def test_every_command_has_help() -> None:
    assert run_cli("--help").returncode == 0
    for command in ("checkout", "apply", "export", "patches", "verify"):
        proc = run_cli(command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert f"usage: lmstool {command}" in proc.stdout


TOOLCHAIN = (REPO_ROOT / "config" / "toolchain.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("toolchain", "expected"),
    [
        (TOOLCHAIN.replace("  v1.13.1:\n", "  v9:\n"), "no entry for v1.13.1"),
        (TOOLCHAIN.replace("{min: 9, max: 13}", "{min: 13, max: 9}"), "min 13 is above max 9"),
        (TOOLCHAIN.replace('      ppc64le: "6.0;7.0;8.0"\n  "12.4"', '  "12.4"'),
         "supports CUDA 11.8 on ppc64le"),
        (TOOLCHAIN.replace("conda_compiler_version:", "# conda_compiler_version:"),
         "missing key 'conda_compiler_version'"),
    ],
)  # fmt: skip
def test_bad_toolchain_names_the_problem(tmp_path: Path, toolchain: str, expected: str) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "tags.yaml").write_text(GOOD, encoding="utf-8")
    (tmp_path / "config" / "toolchain.yaml").write_text(toolchain, encoding="utf-8")
    with pytest.raises(LmsToolError) as exc:
        load_matrix(tmp_path)
    assert expected in str(exc.value)
    assert "toolchain.yaml" in str(exc.value)


def test_one_model_of_tags_and_toolchain() -> None:
    matrix = load_matrix(REPO_ROOT)
    tag = matrix.get_tag("v2.6.0")
    assert tag.gcc is not None and (tag.gcc.min, tag.gcc.max) == (9, 13)
    assert "pybind11" in tag.submodules_for("x86_64") and "fbgemm" in tag.submodules_for("x86_64")
    assert "fbgemm" not in tag.submodules_for("ppc64le")
    assert matrix.cuda_info("12.4").arch_list["ppc64le"] == "6.0;7.0;8.0"
    assert tag.has_series(REPO_ROOT)


def test_every_tag_of_the_matrix_has_its_series() -> None:
    """Every tag config/tags.yaml lists carries an integration series and its committed
    patches in this checkout (a source-only tag would be refused by make patch/build)."""
    matrix = load_matrix(REPO_ROOT)
    assert [t.name for t in matrix.tags_with_series()] == list(matrix.tags)
    for tag in matrix.tags.values():
        assert sorted(tag.series_dir(REPO_ROOT).glob("*.patch")), tag.name


def test_source_only_tag_is_refused_with_the_tags_that_have_a_series(tmp_path: Path) -> None:
    """In a project where only the default tag has a series, every other tag is source only."""
    real = load_matrix(REPO_ROOT)
    shutil.copytree(REPO_ROOT / "config", tmp_path / "config")
    series = tmp_path / real.get_tag(real.default_tag).series_file(tmp_path).relative_to(tmp_path)
    series.parent.mkdir(parents=True)
    series.write_text("0001-engine.engine c10/cuda\n")
    matrix = load_matrix(tmp_path)
    assert [t.name for t in matrix.tags_with_series()] == [real.default_tag]
    others = [name for name in matrix.tags if name != real.default_tag]
    assert others, "the matrix lists more than one tag"
    for name in others:
        with pytest.raises(LmsToolError) as exc:
            matrix.require_series(name)
        assert f"{name} has no LMS series" in str(exc.value)
        assert f"Use {real.default_tag}, or port the series to {name}" in str(exc.value)


def test_tags_only_matrix_serves_the_series_commands(tmp_path: Path) -> None:
    """Without config/toolchain.yaml the series commands work; the build ones say why not."""
    matrix = load_matrix(path=_write(tmp_path, GOOD))
    assert matrix.get_tag("v2.6.0").gcc is None
    with pytest.raises(LmsToolError, match=r"toolchain\.yaml is missing"):
        matrix.cuda_info("12.4")


def test_submodules_must_be_stated(tmp_path: Path) -> None:
    """One loader, one rule: whether a tarball carries the submodules is never guessed."""
    path = _write(tmp_path, GOOD.replace("          submodules: false\n", "", 1))
    with pytest.raises(LmsToolError, match=r"tarballs\[0\]: missing key 'submodules'"):
        load_matrix(path=path)


def test_system_python_without_dependencies_says_what_to_run(tmp_path: Path) -> None:
    import shutil
    import subprocess

    python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if python is None:
        pytest.skip("no system python3 in /usr/bin or /usr/local/bin")
    probe = subprocess.run([python, "-c", "import git"], capture_output=True, check=False)
    if probe.returncode == 0:
        pytest.skip(f"{python} has GitPython: nothing is missing there")
    proc = subprocess.run(
        [python, "-m", "lmstool", "--help"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "lacks GitPython" in proc.stderr and ".venv/bin/python -m lmstool" in proc.stderr
