"""The drop-in's conda package without a GPU or a compiler: recipes/torch-lms/meta.yaml rendered
for a torch release, CUDA and Python, the .conda written from a stand-in of the built wheel,
the channel indexed and read back (and solved) with py-rattler, and `lmstool dropin
--channel`'s wiring."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from lmstool import conda, dropin, dropin_conda
from lmstool.cli import main
from lmstool.errors import LmsToolError

pytest.importorskip(
    "conda_package_handling", reason="needs conda-package-handling (pip install it)"
)
rattler = pytest.importorskip("rattler", reason="channels are read with py-rattler")

REPO = Path(__file__).resolve().parents[2]
SUP = dropin.support()


def built_wheel(out: Path, release: str, cuda: str = "13.0", python: str = "3.12") -> Path:
    """The wheel `lmstool dropin` writes for RELEASE, from the package's real files (Python
    sources, engine API modules, build record) and a stand-in for the compiled module."""
    suffix = f".cpython-{python.replace('.', '')}-x86_64-linux-gnu.so"
    module = out / "obj" / f"_C{suffix}"
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_bytes(b"\x7fELF stand-in for the compiled torch_lms module\n")
    files = dropin.package_files(module, suffix, f"{release}+{SUP.cuda_label(cuda)}", cuda)
    return dropin.write_wheel(
        out / SUP.cuda_label(cuda),
        dropin.wheel_filename(release, cuda, python, "linux_x86_64"),
        files,
        dropin.metadata_text(release, cuda, python),
    )


@pytest.mark.parametrize(
    ("release", "cuda", "python", "build", "cuda_major"),
    [
        ("2.11.0", "13.0", "3.12", "py312_cu130_0", 13),
        ("2.14.1", "12.6", "3.10", "py310_cu126_0", 12),
    ],
)
def test_recipe_renders_the_variant(
    release: str, cuda: str, python: str, build: str, cuda_major: int, tmp_path: Path
) -> None:
    wheel = tmp_path / "torch_lms.whl"
    recipe = dropin_conda.render(REPO, torch=release, cuda=cuda, python=python, wheel=wheel)
    assert recipe["package"] == {"name": "torch-lms", "version": f"{release}.{SUP.SERIAL}"}
    assert recipe["package"]["version"] == SUP.package_version(release)
    assert recipe["build"]["string"] == build and recipe["build"]["number"] == 0
    # The selector `# [not linux64]` drops the skip for the one platform built; a package for
    # any platform is not noarch (it holds a compiled module).
    assert "skip" not in recipe["build"] and "noarch" not in recipe["build"]
    assert recipe["requirements"]["run"] == [
        "python",
        f"pytorch {release} cuda{cuda_major}*",
        f"cuda-version >={cuda_major},<{cuda_major + 1}",
    ]
    assert recipe["source"]["url"] == wheel.resolve().as_uri()
    assert str(wheel.resolve()) in recipe["build"]["script"]
    summary = recipe["about"]["summary"]
    assert f"torch {release} with CUDA {cuda_major}" in summary
    assert any(f"'{release}' in info" in command for command in recipe["test"]["commands"])


@pytest.mark.parametrize(
    ("torch", "cuda", "expect"),
    [
        ("2.10.0", "13.0", "torch 2.10.0: the drop-in supports torch 2.11, 2.12, 2.13 and 2.14"),
        ("2.15.0", "13.0", "supports torch 2.11, 2.12, 2.13 and 2.14, not 2.15"),
        ("2.11", "13.0", "torch '2.11' is not a torch release (X.Y.Z)"),
        ("2.11.0", "13", "--cuda '13' is not a CUDA version"),
    ],
)
def test_render_refuses_what_no_package_is_made_for(
    torch: str, cuda: str, expect: str, tmp_path: Path
) -> None:
    with pytest.raises(LmsToolError) as info:
        dropin_conda.render(REPO, torch=torch, cuda=cuda, python="3.12", wheel=tmp_path / "w.whl")
    assert expect in str(info.value)


def pack(tmp_path: Path, channel: Path, release: str) -> conda.CondaPackage:
    wheel = built_wheel(tmp_path / "out", release)
    return dropin_conda.package(REPO, wheel, channel, torch=release, cuda="13.0", python="3.12")


def repodata(channel: Path, subdir: str) -> dict[str, Any]:
    return dict(json.loads((channel / subdir / "repodata.json").read_text()))


def sparse(channel: Path, subdir: str) -> Any:
    return rattler.SparseRepoData(
        rattler.Channel(channel.resolve().as_uri()), subdir, channel / subdir / "repodata.json"
    )


def test_package_into_a_channel_keeps_each_release(tmp_path: Path) -> None:
    channel = tmp_path / "channel"
    first = pack(tmp_path, channel, "2.11.0")
    name = f"torch-lms-2.11.0.{SUP.SERIAL}-py312_cu130_0.conda"
    assert first.path == channel / "linux-64" / name
    index = conda.read_index(first.path)
    assert index["depends"] == [
        "python >=3.12,<3.13.0a0",
        "pytorch 2.11.0 cuda13*",
        "cuda-version >=13,<14",
    ]
    assert (index["subdir"], index["arch"], index["license"]) == (
        "linux-64",
        "x86_64",
        "BSD-3-Clause",
    )
    assert "noarch" not in index

    # What the recipe's test commands check of the installed files.
    from conda_package_handling import api

    api.extract(str(first.path), dest_dir=str(tmp_path / "x"))
    package = tmp_path / "x/lib/python3.12/site-packages/torch_lms"
    assert "TORCH_VERSION = '2.11.0+cu130'" in (package / "_build_info.py").read_text()
    assert (package / "lms.py").is_file()
    assert (package / "_C.cpython-312-x86_64-linux-gnu.so").is_file()

    pack(tmp_path, channel, "2.14.1")
    listed = repodata(channel, "linux-64")["packages.conda"]
    assert sorted(listed) == [name, f"torch-lms-2.14.1.{SUP.SERIAL}-py312_cu130_0.conda"]
    assert repodata(channel, "noarch")["packages.conda"] == {}

    records = sparse(channel, "linux-64").load_records(rattler.PackageName("torch-lms"))
    found = {str(r.version): (str(r.build), [str(d) for d in r.depends]) for r in records}
    assert found == {
        f"{release}.{SUP.SERIAL}": (
            "py312_cu130_0",
            ["python >=3.12,<3.13.0a0", f"pytorch =={release} cuda13*", "cuda-version >=13,<14"],
        )
        for release in ("2.11.0", "2.14.1")
    }


def write_deps_channel(folder: Path) -> Path:
    """A stand-in for conda-forge's records (repodata only: a solve reads nothing else): the
    drop-in's dependencies, with a CPU build and a CUDA 12 build of each pytorch release
    ranked above the CUDA 13 one, which the solver prefers unless the depends exclude them."""
    records: dict[str, dict[str, Any]] = {}

    def add(name: str, version: str, build: str, number: int, depends: list[str]) -> None:
        records[f"{name}-{version}-{build}.conda"] = {
            "name": name,
            "version": version,
            "build": build,
            "build_number": number,
            "depends": depends,
            "subdir": "linux-64",
            "timestamp": 1767225600000,
            "md5": "0" * 32,
            "sha256": "0" * 64,
            "size": 1,
        }

    add("python", "3.12.8", "0", 0, [])
    add("python", "3.13.1", "0", 0, [])
    for major in ("12.9", "13.0"):
        add("cuda-version", major, "0", 0, [])
    for release in ("2.11.0", "2.14.1"):
        add("pytorch", release, "cuda130_py312_0", 0, ["python >=3.12,<3.13.0a0"])
        add("pytorch", release, "cuda129_py312_1", 1, ["python >=3.12,<3.13.0a0"])
        add("pytorch", release, "cpu_py312_2", 2, ["python >=3.12,<3.13.0a0"])
    for subdir, packages in (("linux-64", records), ("noarch", {})):
        (folder / subdir).mkdir(parents=True, exist_ok=True)
        data = {"info": {"subdir": subdir}, "packages": {}, "packages.conda": packages}
        (folder / subdir / "repodata.json").write_text(json.dumps(data))
    return folder


def solve(channels: list[Path], *specs: str) -> dict[str, tuple[str, str]]:
    sources = [sparse(ch, subdir) for ch in channels for subdir in ("linux-64", "noarch")]
    records = asyncio.run(
        rattler.solve_with_sparse_repodata(
            list(specs),
            sources,
            virtual_packages=[],
            channel_priority=rattler.ChannelPriority.Disabled,
        )
    )
    return {r.name.normalized: (str(r.version), str(r.build)) for r in records}


def test_channel_solves_to_the_package_of_the_torch_release(tmp_path: Path) -> None:
    channel = tmp_path / "channel"
    for release in ("2.11.0", "2.14.1"):
        pack(tmp_path, channel, release)
    deps = write_deps_channel(tmp_path / "deps")
    # Asked for alone, the newest drop-in with the CUDA 13 build of its torch release.
    assert solve([channel, deps], "torch-lms") == {
        "torch-lms": (f"2.14.1.{SUP.SERIAL}", "py312_cu130_0"),
        "pytorch": ("2.14.1", "cuda130_py312_0"),
        "cuda-version": ("13.0", "0"),
        "python": ("3.12.8", "0"),
    }
    # With the torch installed pinned, the drop-in built against that release.
    chosen = solve([channel, deps], "torch-lms", "pytorch ==2.11.0")
    assert chosen["torch-lms"] == (f"2.11.0.{SUP.SERIAL}", "py312_cu130_0")
    assert chosen["pytorch"] == ("2.11.0", "cuda130_py312_0")


def test_package_refuses_the_wheel_of_another_release(tmp_path: Path) -> None:
    wheel = built_wheel(tmp_path / "out", "2.14.1")
    with pytest.raises(LmsToolError) as info:
        dropin_conda.package(
            REPO, wheel, tmp_path / "channel", torch="2.11.0", cuda="13.0", python="3.12"
        )
    expect = f"(torch_lms 2.11.0.{SUP.SERIAL}+cu130): pass the wheel `lmstool dropin --torch 2.11.0"
    assert "is not the drop-in wheel for torch 2.11.0 with CUDA 13.0 " + expect in str(info.value)
    assert not (tmp_path / "channel").exists()


def fake_headers(folder: Path, python: str) -> Path:
    major, minor = python.split(".")
    folder.mkdir(parents=True)
    (folder / "Python.h").write_text("")
    (folder / "patchlevel.h").write_text(
        f"#define PY_MAJOR_VERSION {major}\n#define PY_MINOR_VERSION {minor}\n"
    )
    return folder


def torch_standin(folder: Path, version: str, cuda: str) -> Path:
    meta = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
    files = {"torch/version.py": f"__version__ = '{version}'\ncuda = '{cuda}'\n".encode()}
    return dropin.write_wheel(folder, f"torch-{version}-cp312-cp312-linux_x86_64.whl", files, meta)


def test_dropin_command_writes_the_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmstool dropin --channel` packs the wheel it built for the release, CUDA and Python
    it was given (the compile and link are replaced by the stand-in wheel)."""

    def build_wheel(
        wheel: Any, root: Path, python: Any, out_dir: Path, work: Path, **_: Any
    ) -> dropin.BuildResult:
        path = built_wheel(out_dir, wheel.release, wheel.cuda, python.version)
        return dropin.BuildResult(path, wheel, python, 0.0, "2.28")

    monkeypatch.setattr(dropin, "build_wheel", build_wheel)
    torch_wheel = torch_standin(tmp_path / "wheels", "2.14.1+cu130", "13.0")
    channel = tmp_path / "channel"
    argv = [
        "dropin",
        "--torch",
        "2.14.1",
        "--torch-wheel",
        str(torch_wheel),
        "--python",
        "3.12",
        "--python-include",
        str(fake_headers(tmp_path / "inc", "3.12")),
        "--out",
        str(tmp_path / "out"),
        "--channel",
        str(channel),
        "--cache",
        str(tmp_path / "cache"),
        "--work",
        str(tmp_path / "work"),
    ]
    assert main(argv) == 0
    made = channel / "linux-64" / f"torch-lms-2.14.1.{SUP.SERIAL}-py312_cu130_0.conda"
    assert str(made) in capsys.readouterr().out.splitlines()
    record = repodata(channel, "linux-64")["packages.conda"][made.name]
    assert record["depends"] == [
        "python >=3.12,<3.13.0a0",
        "pytorch ==2.14.1 cuda13*",
        "cuda-version >=13,<14",
    ]


def test_dropin_command_refuses_an_unsupported_release_before_building(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    channel = tmp_path / "channel"
    argv = [
        "dropin",
        "--torch",
        "2.10.0",
        "--out",
        str(tmp_path / "out"),
        "--channel",
        str(channel),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--torch 2.10.0: the drop-in supports torch 2.11, 2.12, 2.13 and 2.14" in err
    assert not channel.exists()
