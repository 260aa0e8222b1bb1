"""Wheel -> .conda without conda, a file:// channel, and offline installs with py-rattler."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmstool import conda
from lmstool.cli import main
from lmstool.errors import LmsToolError

pytest.importorskip(
    "conda_package_handling", reason="needs conda-package-handling (pip install it)"
)
from standin import make_conda_package, make_wheel

PY = "3.11"
SITE = f"lib/python{PY}/site-packages"


def extract(package: Path, dest: Path) -> Path:
    from conda_package_handling import api

    api.extract(str(package), dest_dir=str(dest))
    return dest


@pytest.fixture()
def torch_wheel(tmp_path: Path) -> Path:
    return make_wheel(
        tmp_path / "wheels", console_scripts={"torchrun": "torch.cuda:get_enabled_lms"}
    )


def test_wheel_to_conda_layout_and_metadata(torch_wheel: Path, tmp_path: Path) -> None:
    pkg = conda.wheel_to_conda(
        torch_wheel,
        tmp_path / "channel",
        arch=None,
        cuda="12.6",
        depends=["python", "filelock", "__cuda >=12"],
        about={"license": "BSD-3-Clause"},
        timestamp_ms=1700000000000,
    )
    assert pkg.path == tmp_path / "channel/linux-64/pytorch-2.6.0-py311_cu126_lms_0.conda"
    out = extract(pkg.path, tmp_path / "x")
    index = json.loads((out / "info/index.json").read_text())
    assert index == {
        "arch": "x86_64",
        "build": "py311_cu126_lms_0",
        "build_number": 0,
        "depends": ["python >=3.11,<3.12.0a0", "filelock", "__cuda >=12"],
        "license": "BSD-3-Clause",
        "name": "pytorch",
        "platform": "linux",
        "subdir": "linux-64",
        "timestamp": 1700000000000,
        "version": "2.6.0",
    }
    assert (out / SITE / "torch/__init__.py").read_text().count("2.6.0+lms.cu126") == 1
    assert (out / SITE / "torch/cuda/__init__.py").exists()
    dist = out / SITE / "torch-2.6.0+lms.cu126.dist-info"
    assert (dist / "INSTALLER").read_text() == "conda\n"
    assert "INSTALLER,," in (dist / "RECORD").read_text()
    files = (out / "info/files").read_text().splitlines()
    paths = json.loads((out / "info/paths.json").read_text())
    assert paths["paths_version"] == 1
    assert sorted(files) == sorted(p["_path"] for p in paths["paths"])
    for entry in paths["paths"]:
        data = (out / entry["_path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert len(data) == entry["size_in_bytes"]
    script = out / "bin/torchrun"
    assert script.read_text().startswith(f"#!{conda.PREFIX_PLACEHOLDER}/bin/python\n")
    assert os.access(script, os.X_OK)
    entry = next(p for p in paths["paths"] if p["_path"] == "bin/torchrun")
    assert entry["prefix_placeholder"] == conda.PREFIX_PLACEHOLDER
    assert entry["file_mode"] == "text"
    about = json.loads((out / "info/about.json").read_text())
    assert about["wheel"] == torch_wheel.name and about["license"] == "BSD-3-Clause"


def test_ppc64le_metadata(tmp_path: Path) -> None:
    wheel = make_wheel(
        tmp_path, version="2.6.0+lms.cu124", python="3.12", plat="manylinux_2_28_ppc64le"
    )
    pkg = conda.wheel_to_conda(wheel, tmp_path / "ch", arch="ppc64le", cuda="12.4", depends=[])
    assert pkg.path.parent.name == "linux-ppc64le"
    assert pkg.path.name == "pytorch-2.6.0-py312_cu124_lms_0.conda"
    index = json.loads((extract(pkg.path, tmp_path / "x") / "info/index.json").read_text())
    assert (index["subdir"], index["arch"], index["platform"]) == (
        "linux-ppc64le",
        "ppc64le",
        "linux",
    )
    assert index["depends"] == ["python >=3.12,<3.13.0a0"]
    assert (tmp_path / "x/lib/python3.12/site-packages/torch/__init__.py").exists()


def test_wheel_mismatches_are_errors(torch_wheel: Path, tmp_path: Path) -> None:
    with pytest.raises(LmsToolError, match="x86_64 wheel but --arch is ppc64le"):
        conda.wheel_to_conda(torch_wheel, tmp_path, arch="ppc64le", cuda="12.4", depends=[])
    with pytest.raises(LmsToolError, match=r"for Python 3\.11, not 3\.12"):
        conda.wheel_to_conda(
            torch_wheel, tmp_path, arch=None, cuda="12.6", depends=[], python="3.12"
        )
    with pytest.raises(LmsToolError, match="not a wheel file name"):
        conda.wheel_to_conda(tmp_path / "torch.zip", tmp_path, arch=None, cuda="12.6", depends=[])


def test_torch_wheel_check(tmp_path: Path) -> None:
    """conda-package refuses a torch wheel that is not a CUDA build of the tag with LMS."""
    good = make_wheel(tmp_path / "good")
    conda.check_torch_wheel(good, "v2.6.0", "12.6")
    with pytest.raises(LmsToolError, match=r"PyTorch 2\.6\.0\+lms\.cu126, not v1\.13\.1"):
        conda.check_torch_wheel(good, "v1.13.1", "12.6")
    with pytest.raises(LmsToolError, match=r"built with CUDA 12\.6, not 12\.4: pass --cuda 12\.6"):
        conda.check_torch_wheel(good, "v2.6.0", "12.4")
    # A CPU wheel is refused for being CPU-only, whatever its version.
    stock = make_wheel(tmp_path / "stock", version="2.13.0+cpu")
    with pytest.raises(
        LmsToolError,
        match=r"is a CPU-only build of PyTorch 2\.13\.0\+cpu \(torch/version\.py: cuda = None\), "
        r"and of 2\.13\.0 rather than v2\.6\.0",
    ):
        conda.check_torch_wheel(stock, "v2.6.0", "12.6")
    cpu = make_wheel(tmp_path / "cpu", version="2.6.0+cpu")
    with pytest.raises(LmsToolError, match=r"CPU-only build of PyTorch 2\.6\.0\+cpu \(torch/"):
        conda.check_torch_wheel(cpu, "v2.6.0", "12.6")
    # A CUDA build of another version is refused for its version.
    other = make_wheel(tmp_path / "other", version="2.13.0+cu126")
    with pytest.raises(LmsToolError, match=r"PyTorch 2\.13\.0\+cu126, not v2\.6\.0"):
        conda.check_torch_wheel(other, "v2.6.0", "12.6")
    files = {
        "torch/__init__.py": "__version__ = '2.6.0+cu126'\n",
        "torch/version.py": "__version__ = '2.6.0+cu126'\ncuda = '12.6'\n",
    }
    no_lms = make_wheel(tmp_path / "nolms", version="2.6.0+cu126", files=files)
    with pytest.raises(LmsToolError, match=r"no Large Model Support \(torch/cuda/lms\.py"):
        conda.check_torch_wheel(no_lms, "v2.6.0", "12.6")
    bare = make_wheel(tmp_path / "bare", files={"torch/__init__.py": ""})
    with pytest.raises(LmsToolError, match="not a PyTorch wheel"):
        conda.check_torch_wheel(bare, "v2.6.0", "12.6")


def test_conda_package_cli_refuses_a_stock_wheel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stock = make_wheel(tmp_path / "stock", version="2.13.0+cpu")
    code = main(["conda-package", str(stock), "--cuda", "12.6", "--output-dir", str(tmp_path)])
    assert code != 0
    err = capsys.readouterr().err
    assert "is a CPU-only build of PyTorch 2.13.0+cpu" in err and "rather than v2.6.0" in err
    assert not list(tmp_path.rglob("*.conda"))


def test_conda_package_cli_takes_depends_from_recipe(
    torch_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("jinja2", reason="the recipe is rendered with Jinja2")
    code = main(
        [
            "conda-package",
            str(torch_wheel),
            "--cuda",
            "12.6",
            "--output-dir",
            str(tmp_path / "ch"),
            "--build-number",
            "2",
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    pkg = tmp_path / "ch/linux-64/pytorch-2.6.0-py311_cu126_lms_2.conda"
    assert str(pkg) in out
    index = json.loads((extract(pkg, tmp_path / "x") / "info/index.json").read_text())
    assert index["build_number"] == 2
    assert index["depends"][0] == "python >=3.11,<3.12.0a0"
    for dep in ("cuda-version >=12.6,<13", "__cuda >=12", "cudnn", "nccl", "mkl", "filelock"):
        assert dep in index["depends"]


def test_channel_index(torch_wheel: Path, tmp_path: Path) -> None:
    channel = tmp_path / "ch"
    pkg = conda.wheel_to_conda(torch_wheel, channel, arch=None, cuda="12.6", depends=[])
    counts = conda.index_channel(channel)
    assert counts == {"linux-64": 1, "noarch": 0}
    repodata = json.loads((channel / "linux-64/repodata.json").read_text())
    assert repodata["info"] == {"subdir": "linux-64"} and repodata["packages"] == {}
    record = repodata["packages.conda"][pkg.path.name]
    assert record["sha256"] == hashlib.sha256(pkg.path.read_bytes()).hexdigest()
    assert record["md5"] == hashlib.md5(pkg.path.read_bytes()).hexdigest()
    assert record["size"] == pkg.path.stat().st_size
    assert record["build"] == "py311_cu126_lms_0" and record["name"] == "pytorch"
    noarch = json.loads((channel / "noarch/repodata.json").read_text())
    assert noarch["packages.conda"] == {}


def test_channel_index_rejects_package_in_wrong_subdir(torch_wheel: Path, tmp_path: Path) -> None:
    channel = tmp_path / "ch"
    pkg = conda.wheel_to_conda(torch_wheel, channel, arch=None, cuda="12.6", depends=[])
    (channel / "linux-ppc64le").mkdir()
    pkg.path.rename(channel / "linux-ppc64le" / pkg.path.name)
    with pytest.raises(LmsToolError, match="linux-64 package in the linux-ppc64le folder"):
        conda.index_channel(channel)
    placed = conda.add_to_channel(channel, [channel / "linux-ppc64le" / pkg.path.name])
    assert placed == [channel / "linux-64" / pkg.path.name]
    assert not (channel / "linux-ppc64le" / pkg.path.name).exists()
    assert conda.index_channel(channel)["linux-64"] == 1


def _populated_channel(tmp_path: Path) -> Path:
    """A channel with stand-in torch (both arches), its helper dependency and python."""
    channel = tmp_path / "channel"
    wheels = tmp_path / "wheels"
    packages = []
    for arch, subdir, cuda, plat in (
        ("x86_64", "linux-64", "12.6", "manylinux_2_28_x86_64"),
        ("ppc64le", "linux-ppc64le", "12.4", "manylinux_2_28_ppc64le"),
    ):
        cu = cuda.replace(".", "")
        torch = make_wheel(
            wheels / arch,
            version=f"2.6.0+lms.cu{cu}",
            plat=plat,
            console_scripts={"torchrun": "torch.cuda:get_enabled_lms"},
        )
        helper = make_wheel(
            wheels / arch,
            name="lmshelper",
            version="1.0",
            plat=plat,
            files={"lmshelper/__init__.py": "VALUE = 42\n"},
        )
        packages.append(
            conda.wheel_to_conda(
                torch,
                tmp_path / "out",
                arch=arch,
                cuda=cuda,
                depends=["python", "lmshelper >=1.0"],
            ).path
        )
        packages.append(
            conda.wheel_to_conda(
                helper,
                tmp_path / "out",
                arch=arch,
                cuda=cuda,
                depends=["python"],
                name="lmshelper",
            ).path
        )
        packages.append(
            make_conda_package(
                tmp_path / "out" / subdir,
                name="python",
                version="3.11.7",
                subdir=subdir,
                files={"bin/python3.11": "stand-in interpreter\n"},
            )
        )
    conda.add_to_channel(channel, packages)
    return channel


def _conda_meta(prefix: Path) -> dict[str, dict[str, object]]:
    records = {}
    for path in (prefix / "conda-meta").glob("*.json"):
        data = json.loads(path.read_text())
        records[data["name"]] = data
    return records


def test_install_round_trip_linux_64(tmp_path: Path) -> None:
    pytest.importorskip(
        "rattler", reason="offline installs use py-rattler (pip install py-rattler)"
    )
    channel = _populated_channel(tmp_path)
    prefix = tmp_path / "env"
    records = conda.install(
        channel,
        ["pytorch 2.6.* *_lms_*"],
        prefix,
        platform="linux-64",
        cache_dir=tmp_path / "cache",
    )
    assert {r["name"] for r in records} == {"pytorch", "lmshelper", "python"}
    meta = _conda_meta(prefix)
    torch = meta["pytorch"]
    assert (torch["version"], torch["build"], torch["subdir"]) == (
        "2.6.0",
        "py311_cu126_lms_0",
        "linux-64",
    )
    assert torch["depends"] == ["python >=3.11,<3.12.0a0", "lmshelper >=1.0"]
    site = prefix / SITE
    assert (site / "torch/cuda/__init__.py").exists()
    assert (site / "lmshelper/__init__.py").read_text() == "VALUE = 42\n"
    assert (prefix / "bin/torchrun").read_text().startswith(f"#!{prefix}/bin/python\n")
    # The installed package is importable and carries the LMS API.
    probe = (
        "import torch; torch.cuda.set_enabled_lms(True); "
        "print(torch.__version__, torch.cuda.get_enabled_lms())"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["2.6.0+lms.cu126", "True"]


def test_install_round_trip_linux_ppc64le(tmp_path: Path) -> None:
    pytest.importorskip(
        "rattler", reason="offline installs use py-rattler (pip install py-rattler)"
    )
    channel = _populated_channel(tmp_path)
    prefix = tmp_path / "env-ppc"
    records = conda.install(
        channel, ["pytorch"], prefix, platform="linux-ppc64le", cache_dir=tmp_path / "cache"
    )
    assert {(r["name"], r["subdir"]) for r in records} == {
        ("pytorch", "linux-ppc64le"),
        ("lmshelper", "linux-ppc64le"),
        ("python", "linux-ppc64le"),
    }
    torch = _conda_meta(prefix)["pytorch"]
    assert (torch["build"], torch["subdir"]) == ("py311_cu124_lms_0", "linux-ppc64le")
    init = prefix / SITE / "torch/__init__.py"
    assert '__version__ = "2.6.0+lms.cu124"' in init.read_text()


def test_install_reports_missing_dependencies(tmp_path: Path) -> None:
    pytest.importorskip(
        "rattler", reason="offline installs use py-rattler (pip install py-rattler)"
    )
    channel = tmp_path / "ch"
    wheel = make_wheel(tmp_path / "w")
    conda.wheel_to_conda(wheel, channel, arch=None, cuda="12.6", depends=["python", "cudnn"])
    conda.index_channel(channel)
    with pytest.raises(LmsToolError, match="python") as info:
        conda.install(
            channel,
            ["pytorch"],
            tmp_path / "env",
            platform="linux-64",
            cache_dir=tmp_path / "cache",
        )
    assert "lmstool channel add" in str(info.value)
    assert not (tmp_path / "env" / "conda-meta").exists()


def test_channel_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip(
        "rattler", reason="offline installs use py-rattler (pip install py-rattler)"
    )
    channel = _populated_channel(tmp_path)
    assert main(["channel", "index", str(channel)]) == 0
    out, _ = capsys.readouterr()
    assert f"{channel / 'linux-64' / 'repodata.json'}: 3 package(s)" in out
    code = main(
        [
            "channel",
            "install",
            "pytorch",
            "--channel",
            str(channel),
            "--prefix",
            str(tmp_path / "env"),
            "--platform",
            "linux-ppc64le",
            "--cache-dir",
            str(tmp_path / "cache"),
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    assert "pytorch 2.6.0 py311_cu124_lms_0 (linux-ppc64le)" in out
    code = main(
        [
            "channel",
            "install",
            "pytorch",
            "--channel",
            str(tmp_path / "nowhere"),
            "--prefix",
            str(tmp_path / "e2"),
        ]
    )
    _, err = capsys.readouterr()
    assert code == 2 and "lmstool channel index" in err
