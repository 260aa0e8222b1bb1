"""The prebuilt drop-in without a GPU: naming and pip's choice among the wheels, the import
check against the torch it is loaded into, and lmstool dropin's errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmstool import dropin
from lmstool.cli import main

REPO = Path(__file__).resolve().parents[2]
SUP = dropin.support()


def test_support_lists_2_11_to_2_14_and_releases_cover_them() -> None:
    assert SUP.SUPPORTED_MINORS == ("2.11", "2.12", "2.13", "2.14")
    assert {".".join(r.split(".")[:2]) for r in dropin.RELEASES} == set(SUP.SUPPORTED_MINORS)
    assert dropin.newest_per_minor() == ["2.11.0", "2.12.1", "2.13.0", "2.14.1"]


def test_names_say_torch_release_and_cuda() -> None:
    assert SUP.package_version("2.11.0+cu130") == f"2.11.0.{SUP.SERIAL}"
    assert dropin.wheel_version("2.11.0", "13.0") == f"2.11.0.{SUP.SERIAL}+cu130"
    assert dropin.wheel_filename("2.11.0", "13.0", "3.12", "linux_x86_64") == (
        f"torch_lms-2.11.0.{SUP.SERIAL}+cu130-cp312-cp312-linux_x86_64.whl"
    )
    meta = dropin.metadata_text("2.11.0", "13.0", "3.12")
    assert "Requires-Dist: torch==2.11.0\n" in meta and "Name: torch-lms\n" in meta


@pytest.mark.parametrize(
    ("torch_version", "cuda", "expect"),
    [
        ("2.11.0+cu130", "13.0", ""),
        ("2.11.0", "13.0", ""),  # PyPI's wheel says 2.11.0 in its metadata
        ("2.11.0+cu130", "13.1", ""),  # one CUDA major, one runtime soname
        ("2.14.1+cu130", "13.0", '"torch-lms==2.14.1.*"'),
        ("2.11.0+cu126", "12.6", "--find-links DIR/cu126"),
        ("2.10.0+cu128", "12.8", "supports torch 2.11, 2.12, 2.13 and 2.14"),
        ("2.11.0+cpu", None, "needs a CUDA build"),
    ],
)
def test_mismatch_names_the_matching_package(
    torch_version: str, cuda: str | None, expect: str
) -> None:
    message = SUP.mismatch("2.11.0+cu130", "13.0", torch_version, cuda)
    if not expect:
        assert message == ""
    else:
        assert expect in message and "built for torch 2.11.0 with CUDA 13" in message


def _fake_torch(root: Path, version: str, cuda: str) -> None:
    """A stand-in torch package: what torch_lms's import check reads of torch."""
    pkg = root / "torch"
    (pkg / "version").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            import types
            __version__ = {version!r}
            from torch import version
            _C = types.SimpleNamespace()
            cuda = types.SimpleNamespace(is_available=lambda: True)
            """
        )
    )
    (pkg / "version" / "__init__.py").write_text(f"cuda = {cuda!r}\n")


def _import_torch_lms(
    tmp_path: Path, built: str, torch_version: str
) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    package = site / "torch_lms"
    package.mkdir(parents=True)
    for name in dropin.PACKAGE_FILES:
        shutil.copy(REPO / "extension/torch_lms" / name, package / name)
    (package / "_build_info.py").write_text(
        dropin.build_info_text(built, "13.0", dropin.wheel_version(built, "13.0"))
    )
    _fake_torch(site, torch_version, "13.0")
    return subprocess.run(
        [sys.executable, "-c", "import torch_lms"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp_path,
        check=False,
    )


def test_import_refuses_another_torch_release(tmp_path: Path) -> None:
    proc = _import_torch_lms(tmp_path, "2.11.0+cu130", "2.14.1+cu130")
    assert proc.returncode != 0
    assert "ImportError: torch_lms: this package was built for torch 2.11.0" in proc.stderr
    assert 'pip install --no-index --find-links DIR/cu130 "torch-lms==2.14.1.*"' in proc.stderr


def test_import_of_the_matching_release_passes_the_check(tmp_path: Path) -> None:
    # The check passes; loading the (absent) compiled module is what fails next.
    proc = _import_torch_lms(tmp_path, "2.11.0+cu130", "2.11.0+cu130")
    assert "this package was built for" not in proc.stderr
    assert "cannot import name '_C'" in proc.stderr


def _wheel(folder: Path, release: str) -> Path:
    files = {"torch_lms/__init__.py": b"", "torch_lms/_C.cpython-312-x86_64-linux-gnu.so": b""}
    name = dropin.wheel_filename(release, "13.0", "3.11", "any")
    # A pure tag (py3-none-any) lets this machine's pip take the stand-ins.
    name = name.replace("-cp311-cp311-any", "-py3-none-any")
    return dropin.write_wheel(folder, name, files, dropin.metadata_text(release, "13.0", "3.11"))


def _torch_standin(folder: Path, version: str) -> Path:
    meta = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
    return dropin.write_wheel(
        folder, f"torch-{version}-py3-none-any.whl", {"torch/__init__.py": b""}, meta
    )


def _pip_choice(folder: Path, *requirements: str) -> dict[str, str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-index",
            "--find-links",
            str(folder),
            "--quiet",
            "--report",
            "-",
            *requirements,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(proc.stdout)
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in report["install"]}


def test_pip_takes_the_package_of_the_torch_it_can_have(tmp_path: Path) -> None:
    """Offline, torch cannot change: of the packages for 2.11.0, 2.12.1 and 2.14.1 pip takes
    the one whose torch requirement is met, although newer ones are offered."""
    wheels = tmp_path / "wheels"
    for release in ("2.11.0", "2.12.1", "2.14.1"):
        _wheel(wheels, release)
    _torch_standin(wheels, "2.11.0")
    chosen = _pip_choice(wheels, "torch-lms")
    assert chosen == {"torch-lms": f"2.11.0.{SUP.SERIAL}+cu130", "torch": "2.11.0"}
    _torch_standin(wheels, "2.12.1")
    assert _pip_choice(wheels, "torch-lms==2.12.1.*")["torch-lms"].startswith("2.12.1.")


def test_wheel_record_lists_every_file(tmp_path: Path) -> None:
    import zipfile

    wheel = _wheel(tmp_path, "2.11.0")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        record = archive.read(next(n for n in names if n.endswith("RECORD"))).decode()
    listed = {line.split(",")[0] for line in record.splitlines()}
    assert listed == names


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--torch", "2.10.0"], "--torch 2.10.0: the drop-in supports torch 2.11, 2.12, 2.13"),
        (["--torch", "2.10.0"], "type, for example, --torch 2.14.0"),
        (["--torch", "2.11"], "--torch '2.11' is not a torch release (X.Y.Z)"),
        (["--torch", "2.11.0", "--cuda", "13"], "--cuda '13' is not a CUDA version"),
        (
            ["--torch", "2.11.0", "--python-include", "/nonexistent"],
            "--python-include needs --python X.Y",
        ),
        (
            ["--torch", "2.11.0", "--torch", "2.12.1", "--torch-wheel", "x.whl"],
            "give exactly one --torch",
        ),
    ],
)
def test_dropin_command_errors(
    argv: list[str], expect: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dropin", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmstool dropin: error: ") and expect in err


def test_dropin_refuses_a_cpu_torch_wheel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n"
    files = {"torch/version.py": b"__version__ = '2.13.0+cpu'\ncuda = None\n"}
    wheel = dropin.write_wheel(
        tmp_path, "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", files, meta
    )
    code = main(
        ["dropin", "--torch", "2.13.0", "--torch-wheel", str(wheel), "--out", str(tmp_path)]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "is torch 2.13.0+cpu (CPU-only), not torch 2.13.0 for CUDA 13.0" in err


def test_torchcheck_torch_needs_dropin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["torchcheck", "--torch", "2.11.0"]) == 2
    assert "--torch goes with --dropin" in capsys.readouterr().err
