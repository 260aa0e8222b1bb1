"""Conda packages without conda: a wheel turned into a ``.conda``, a file:// channel, installs.

* :func:`wheel_to_conda` unpacks a built wheel into a conda prefix layout
  (``lib/pythonX.Y/site-packages``, ``bin/`` for scripts and entry points), writes the
  ``info/`` metadata conda clients read (index.json, paths.json, files, about.json, has_prefix)
  and creates the archive with conda-package-handling.
* :func:`index_channel` indexes a channel with py-rattler's indexer (``rattler.index``), which
  writes ``repodata.json`` for every subdir (and an empty ``noarch``) as conda-index does.
* :func:`install` solves specs against such a channel with py-rattler and links the result
  into a prefix, offline; the target platform can be another architecture (rattler only
  links files, it runs nothing from the package).
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmstool.errors import LmsToolError
from lmstool.hints import option, via_make
from lmstool.naming import CONDA_SUBDIRS, conda_build_string

# conda-build's placeholder for the install prefix, replaced by the client at link time.
PREFIX_PLACEHOLDER = "/opt/anaconda1anaconda2anaconda3"
SUBDIR_ARCH = {subdir: arch for arch, subdir in CONDA_SUBDIRS.items()}
WHEEL_NAME = re.compile(
    r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)(-(?P<build>\d[^-]*))?"
    r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


def _need_cph() -> Any:
    try:
        from conda_package_handling import api
    except ModuleNotFoundError:
        raise LmsToolError(
            "creating .conda archives needs conda-package-handling: "
            "pip install 'conda-package-handling>=2.2'"
        ) from None
    return api


def _need_streaming() -> Any:
    try:
        from conda_package_streaming import package_streaming
    except ModuleNotFoundError:
        raise LmsToolError(
            "reading .conda archives needs conda-package-streaming (installed with "
            "conda-package-handling): pip install 'conda-package-handling>=2.2'"
        ) from None
    return package_streaming


def _need_rattler() -> Any:
    try:
        import rattler
    except ModuleNotFoundError:
        raise LmsToolError(
            "installing from a channel needs py-rattler: pip install 'py-rattler>=0.10'"
        ) from None
    return rattler


# --------------------------------------------------------------------------------------------
# Wheels


@dataclass(frozen=True)
class WheelInfo:
    path: Path
    name: str
    version: str
    python_tag: str
    abi_tag: str
    platform_tag: str

    @classmethod
    def parse(cls, path: Path) -> WheelInfo:
        match = WHEEL_NAME.match(path.name)
        if match is None:
            raise LmsToolError(
                f"{path.name} is not a wheel file name (name-version-python-abi-platform.whl)"
            )
        return cls(
            path=path,
            name=match["name"],
            version=match["version"],
            python_tag=match["py"],
            abi_tag=match["abi"],
            platform_tag=match["plat"],
        )

    @property
    def python(self) -> str | None:
        """X.Y for a CPython-specific wheel (cp311 -> 3.11); None for py3 wheels."""
        tag = self.python_tag.split(".")[0]
        match = re.fullmatch(r"cp(\d)(\d+)", tag)
        return f"{match[1]}.{match[2]}" if match else None

    @property
    def arch(self) -> str | None:
        for arch in CONDA_SUBDIRS:
            if self.platform_tag.endswith(arch):
                return arch
        return None

    @property
    def public_version(self) -> str:
        return self.version.split("+")[0]


# What a torch wheel says of itself in torch/version.py (PyTorch writes it at build time).
_VERSION_LINE = re.compile(r"""^__version__\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.M)
_CUDA_LINE = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*(None|['"]([^'"]*)['"])""", re.M)
# The module the LMS series adds to torch.cuda: its presence marks a build with LMS.
LMS_MODULE = "torch/cuda/lms.py"


def check_torch_wheel(path: Path, tag: str, cuda: str) -> None:
    """Refuses a torch wheel that is not what a package of ``tag`` with LMS for CUDA
    ``cuda`` must hold: a CPU-only build (whatever its version), another PyTorch version or a
    build for another CUDA (``torch/version.py``), or a build without the LMS series (no
    ``torch/cuda/lms.py``). Each error says which, and what to pass instead."""
    wheel = WheelInfo.parse(path)
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            version_py = (
                archive.read("torch/version.py").decode() if "torch/version.py" in names else ""
            )
    except (OSError, zipfile.BadZipFile) as exc:
        raise LmsToolError(f"{path} is not a readable wheel ({exc})") from None
    if not version_py:
        raise LmsToolError(
            f"{path.name} has no torch/version.py: it is not a PyTorch wheel (build one with "
            f"`make build TAG={tag}`)"
        )
    found = _VERSION_LINE.search(version_py)
    version = found[1] if found else wheel.version
    release = version.split("+")[0]
    wanted = tag.removeprefix("v")
    built = _CUDA_LINE.search(version_py)
    built_cuda = None if built is None or built[1] == "None" else built[2]
    # A CPU-only build is refused for being one before its version is looked at: a stock CPU
    # wheel (the torch of a CPU machine's pip) is the likely mistake, and no --tag fixes it.
    if not built_cuda:
        said = "cuda = None" if built is not None else "no cuda line"
        other = f", and of {release} rather than {tag}" if release != wanted else ""
        raise LmsToolError(
            f"{path.name} is a CPU-only build of PyTorch {version} (torch/version.py: {said})"
            f"{other}; an LMS package holds a CUDA build of {tag} with the LMS series: build "
            f"that wheel with a CUDA toolkit (`make build TAG={tag}`)"
        )
    if release != wanted:
        raise LmsToolError(
            f"{path.name} is PyTorch {version}, not {tag}: package the wheel built from {tag}, "
            f"or pass --tag v{release} if that tag has a series"
        )
    if built_cuda != cuda:
        raise LmsToolError(
            f"{path.name} was built with CUDA {built_cuda}, not {cuda}: pass --cuda {built_cuda}"
            " (the package's dependencies follow it)"
        )
    if LMS_MODULE not in names:
        raise LmsToolError(
            f"{path.name} has no Large Model Support ({LMS_MODULE} is missing): build it from "
            f"the patched tree (`make build TAG={tag}`), not from a stock checkout"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _safe_member(name: str) -> str:
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts:
        raise LmsToolError(f"the wheel holds an unsafe path {name!r}; rebuild the wheel")
    return name


def _unpack_wheel(wheel: WheelInfo, prefix: Path, python: str) -> Path:
    """Lay the wheel out as conda installs Python packages; return the .dist-info folder."""
    site = prefix / "lib" / f"python{python}" / "site-packages"
    data_dir = f"{wheel.name}-{wheel.version}.data/"
    dist_info: Path | None = None
    try:
        archive = zipfile.ZipFile(wheel.path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise LmsToolError(f"{wheel.path} is not a readable wheel ({exc})") from None
    with archive:
        for member in archive.infolist():
            if member.is_dir():
                continue
            name = _safe_member(member.filename)
            if name.startswith(data_dir):
                kind, _, rest = name[len(data_dir) :].partition("/")
                targets = {
                    "purelib": site,
                    "platlib": site,
                    "scripts": prefix / "bin",
                    "data": prefix,
                    "headers": prefix / "include" / f"python{python}" / wheel.name,
                }
                if kind not in targets:
                    raise LmsToolError(f"{wheel.path.name}: unknown wheel data folder {kind!r}")
                target = targets[kind] / rest
            else:
                target = site / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (member.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode | 0o600)
            if target.parent.name.endswith(".dist-info") and target.parent.parent == site:
                dist_info = target.parent
    if dist_info is None:
        raise LmsToolError(f"{wheel.path.name} has no .dist-info folder; it is not a wheel")
    return dist_info


def _fix_scripts(prefix: Path) -> None:
    """Wheel scripts start with '#!python'; point them at the prefix's interpreter."""
    bindir = prefix / "bin"
    if not bindir.is_dir():
        return
    for script in bindir.iterdir():
        data = script.read_bytes()
        if data.startswith((b"#!python", b"#!/usr/bin/env python")):
            _, _, rest = data.partition(b"\n")
            script.write_bytes(f"#!{PREFIX_PLACEHOLDER}/bin/python".encode() + b"\n" + rest)
            script.chmod(0o755)


def _entry_points(dist_info: Path, prefix: Path) -> list[str]:
    """Write bin/ launchers for console_scripts, as conda-build does for pip-built packages."""
    path = dist_info / "entry_points.txt"
    if not path.exists():
        return []
    import configparser

    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path, encoding="utf-8")
    if not parser.has_section("console_scripts"):
        return []
    written = []
    for name, target in parser.items("console_scripts"):
        module, _, func = target.strip().partition(":")
        func = func.split("[")[0].strip()
        head = func.split(".")[0]
        script = prefix / "bin" / name
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(
            f"#!{PREFIX_PLACEHOLDER}/bin/python\n"
            "# -*- coding: utf-8 -*-\n"
            "import re\n"
            "import sys\n\n"
            f"from {module.strip()} import {head}\n\n"
            "if __name__ == '__main__':\n"
            "    sys.argv[0] = re.sub(r'(-script\\.pyw?|\\.exe)?$', '', sys.argv[0])\n"
            f"    sys.exit({func}())\n",
            encoding="utf-8",
        )
        script.chmod(0o755)
        written.append(name)
    return written


def _rewrite_record(dist_info: Path, site: Path) -> None:
    """Mark the distribution as installed by conda and keep RECORD matching the files."""
    installer = dist_info / "INSTALLER"
    installer.write_text("conda\n", encoding="utf-8")
    record = dist_info / "RECORD"
    if not record.exists():
        return
    rows = [
        row
        for row in csv.reader(io.StringIO(record.read_text(encoding="utf-8")))
        if row and not row[0].endswith("/INSTALLER")
    ]
    rows.append([installer.relative_to(site).as_posix(), "", ""])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    record.write_text(out.getvalue(), encoding="utf-8")


def _paths_json(prefix: Path) -> tuple[list[str], list[dict[str, Any]], list[str]]:
    files: list[str] = []
    entries: list[dict[str, Any]] = []
    has_prefix: list[str] = []
    placeholder = PREFIX_PLACEHOLDER.encode()
    for path in sorted(p for p in prefix.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(prefix).as_posix()
        if rel.startswith("info/"):
            continue
        files.append(rel)
        entry: dict[str, Any] = {"_path": rel}
        if path.is_symlink():
            entry["path_type"] = "softlink"
            entry["sha256"] = hashlib.sha256(str(path.readlink()).encode()).hexdigest()
            entry["size_in_bytes"] = len(str(path.readlink()))
        else:
            entry["path_type"] = "hardlink"
            entry["sha256"] = _sha256(path)
            entry["size_in_bytes"] = path.stat().st_size
            if placeholder in path.read_bytes():
                entry["file_mode"] = "text"
                entry["prefix_placeholder"] = PREFIX_PLACEHOLDER
                has_prefix.append(f"{PREFIX_PLACEHOLDER} text {rel}")
        entries.append(entry)
    return files, entries, has_prefix


@dataclass(frozen=True)
class CondaPackage:
    path: Path
    index: dict[str, Any]

    @property
    def subdir(self) -> str:
        return str(self.index["subdir"])


def wheel_to_conda(
    wheel_path: Path,
    output_dir: Path,
    *,
    arch: str | None,
    cuda: str,
    depends: Sequence[str],
    name: str = "pytorch",
    version: str | None = None,
    build_number: int = 0,
    build: str | None = None,
    about: Mapping[str, Any] | None = None,
    python: str | None = None,
    timestamp_ms: int | None = None,
) -> CondaPackage:
    """Turn a wheel into OUTPUT_DIR/<subdir>/<name>-<version>-<build>.conda."""
    wheel = WheelInfo.parse(wheel_path)
    if not wheel_path.is_file():
        raise LmsToolError(f"{wheel_path} does not exist: build the wheel first")
    wheel_arch = wheel.arch
    if arch is None:
        if wheel_arch is None:
            raise LmsToolError(
                f"{wheel_path.name} is for platform {wheel.platform_tag}; pass --arch x86_64 "
                "or --arch ppc64le"
            )
        arch = wheel_arch
    if arch not in CONDA_SUBDIRS:
        raise LmsToolError(f"unknown architecture {arch!r}: use x86_64 or ppc64le")
    if wheel_arch is not None and wheel_arch != arch:
        raise LmsToolError(
            f"{wheel_path.name} is a {wheel_arch} wheel but --arch is {arch}; a conda "
            f"package for {CONDA_SUBDIRS[arch]} needs a wheel built on {arch}"
        )
    wheel_python = wheel.python
    python = python or wheel_python
    if python is None:
        raise LmsToolError(
            f"{wheel_path.name} does not say its CPython version ({wheel.python_tag}); pass "
            "--python X.Y"
        )
    if wheel_python is not None and wheel_python != python:
        raise LmsToolError(
            f"{wheel_path.name} is for Python {wheel_python}, not {python}: pass the matching "
            "--python or rebuild the wheel"
        )
    version = version or wheel.public_version
    build = build or conda_build_string(python, cuda, build_number)
    subdir = CONDA_SUBDIRS[arch]
    nodot = python.replace(".", "")
    major, minor = python.split(".")
    pinned = [
        f"python >={python},<{major}.{int(minor) + 1}.0a0" if dep.strip() == "python" else dep
        for dep in depends
    ]
    if not any(dep.split()[0] == "python" for dep in pinned):
        pinned.insert(0, f"python >={python},<{major}.{int(minor) + 1}.0a0")
    index = {
        "name": name,
        "version": version,
        "build": build,
        "build_number": build_number,
        "depends": pinned,
        "license": str((about or {}).get("license", "")),
        "license_family": str((about or {}).get("license_family", "")),
        "subdir": subdir,
        "arch": arch,
        "platform": "linux",
        "timestamp": timestamp_ms if timestamp_ms is not None else int(time.time() * 1000),
    }
    if not index["license_family"]:
        del index["license_family"]
    if not index["license"]:
        del index["license"]

    out_dir = output_dir / subdir
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{version}-{build}"
    target = out_dir / f"{stem}.conda"
    cph = _need_cph()
    with tempfile.TemporaryDirectory(prefix="lms-conda-") as tmp:
        prefix = Path(tmp) / "prefix"
        dist_info = _unpack_wheel(wheel, prefix, python)
        site = prefix / "lib" / f"python{python}" / "site-packages"
        _rewrite_record(dist_info, site)
        _fix_scripts(prefix)
        _entry_points(dist_info, prefix)
        files, entries, has_prefix = _paths_json(prefix)
        info = prefix / "info"
        info.mkdir()
        (info / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (info / "paths.json").write_text(
            json.dumps({"paths": entries, "paths_version": 1}, indent=2, sort_keys=True) + "\n"
        )
        (info / "files").write_text("".join(f"{f}\n" for f in files))
        about_data = {
            **dict(about or {}),
            "wheel": wheel_path.name,
            "wheel_version": wheel.version,
            "python_tag": f"cp{nodot}",
        }
        (info / "about.json").write_text(json.dumps(about_data, indent=2, sort_keys=True) + "\n")
        if has_prefix:
            (info / "has_prefix").write_text("".join(f"{line}\n" for line in has_prefix))
        members = sorted(p.relative_to(prefix).as_posix() for p in prefix.rglob("*") if p.is_file())
        target.unlink(missing_ok=True)
        cph.create(str(prefix), members, f"{stem}.conda", out_folder=str(out_dir))
    if not target.is_file():
        raise LmsToolError(f"conda-package-handling did not write {target}")
    return CondaPackage(target, index)


# --------------------------------------------------------------------------------------------
# Channels


def read_index(package: Path) -> dict[str, Any]:
    """info/index.json of a .conda or .tar.bz2 package."""
    streaming = _need_streaming()
    try:
        with package.open("rb") as handle:
            for tar, member in streaming.stream_conda_info(package.name, handle):
                if member.name == "info/index.json":
                    extracted = tar.extractfile(member)
                    if extracted is not None:
                        return dict(json.load(extracted))
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise LmsToolError(f"{package} is not a readable conda package ({exc})") from None
    raise LmsToolError(f"{package} has no info/index.json; it is not a conda package")


def _package_files(folder: Path) -> list[Path]:
    return sorted([*folder.glob("*.conda"), *folder.glob("*.tar.bz2")])


def index_channel(channel: Path) -> dict[str, int]:
    """Index every subdir of CHANNEL (and noarch) with py-rattler; return package counts.

    A package whose index.json names another subdir than its folder is refused first: the
    indexer would list it under the folder's subdir, where no client of its platform looks.
    """
    if not channel.is_dir():
        other = f", or index another with {option('channel', 'DIR')}" if via_make() else ""
        raise LmsToolError(
            f"{channel} is not a folder: create it or build a package into it{other}"
        )
    subdirs = {p.name for p in channel.iterdir() if p.is_dir() and not p.name.startswith(".")}
    subdirs.add("noarch")
    for subdir in sorted(subdirs):
        folder = channel / subdir
        folder.mkdir(exist_ok=True)
        for package in _package_files(folder):
            record = read_index(package)
            if record.get("subdir", subdir) != subdir:
                raise LmsToolError(
                    f"{package} is a {record.get('subdir')} package in the {subdir} folder: "
                    f"move it to {channel / str(record.get('subdir'))} (lmstool channel add "
                    "does this)"
                )
    _need_rattler()  # a clear message when py-rattler is missing
    from rattler.index import index_fs

    try:
        # force: a package rebuilt under the same file name is read again, not taken from
        # the previous repodata.json. Plain repodata.json only: what every client reads.
        asyncio.run(
            index_fs(channel, write_zst=False, write_shards=False, force=True)  # type: ignore[arg-type]
        )
    except Exception as exc:
        raise LmsToolError(f"py-rattler could not index {channel}: {exc}") from None
    counts: dict[str, int] = {}
    for subdir in sorted(subdirs):
        path = channel / subdir / "repodata.json"
        if not path.is_file():
            raise LmsToolError(f"py-rattler wrote no {path}")
        repodata = json.loads(path.read_text(encoding="utf-8"))
        counts[subdir] = len(repodata.get("packages") or {}) + len(
            repodata.get("packages.conda") or {}
        )
    return counts


def add_to_channel(channel: Path, packages: Sequence[Path]) -> list[Path]:
    """Copy packages into the subdir their index.json names (moving ones already inside the
    channel), then reindex."""
    placed = []
    for package in packages:
        if not package.is_file():
            raise LmsToolError(f"{package} does not exist")
        subdir = str(read_index(package).get("subdir", "noarch"))
        dest = channel / subdir / package.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.resolve() == package.resolve():
            pass
        elif package.resolve().is_relative_to(channel.resolve()):
            shutil.move(str(package), dest)  # misplaced inside the channel: move it
        else:
            shutil.copy2(package, dest)
        placed.append(dest)
    index_channel(channel)
    return placed


def install(
    channel: Path,
    specs: Sequence[str],
    prefix: Path,
    *,
    platform: str | None = None,
    cache_dir: Path | None = None,
    virtual_packages: Sequence[str] = (),
) -> list[dict[str, str]]:
    """Solve SPECS against CHANNEL alone and link the result into PREFIX, offline."""
    rattler = _need_rattler()
    if not (channel / "noarch" / "repodata.json").exists():
        raise LmsToolError(
            f"{channel} is not an indexed channel (no noarch/repodata.json): run "
            f"`lmstool channel index {channel}`"
        )
    subdir = platform or str((getattr(rattler, "Subdir", None) or rattler.Platform).current())
    if subdir not in (*SUBDIR_ARCH, "noarch"):
        raise LmsToolError(f"unknown platform {subdir!r}: use linux-64 or linux-ppc64le")
    subdir_cls = getattr(rattler, "Subdir", None) or rattler.Platform
    cache = cache_dir or Path(tempfile.mkdtemp(prefix="lms-rattler-cache-"))
    virtuals = []
    for item in virtual_packages:
        pkg_name, _, pkg_version = item.partition("=")
        virtuals.append(
            rattler.GenericVirtualPackage(
                rattler.PackageName(pkg_name),
                rattler.Version(pkg_version or "0"),
                rattler.BuildString("0") if hasattr(rattler, "BuildString") else "0",
            )
        )
    channel_url = channel.resolve().as_uri()

    async def _run() -> list[Any]:
        gateway = rattler.Gateway(cache_dir=cache / "repodata")
        records = await rattler.solve(
            [rattler.Channel(channel_url)],
            list(specs),
            gateway=gateway,
            platforms=[subdir_cls(subdir), subdir_cls("noarch")],
            virtual_packages=virtuals,
            channel_relations="disabled",
        )
        await rattler.install(
            records,
            target_prefix=prefix,
            cache_dir=cache / "pkgs",
            platform=subdir_cls(subdir),
            show_progress=False,
        )
        return list(records)

    try:
        records = asyncio.run(_run())
    except Exception as exc:
        if isinstance(exc, LmsToolError):
            raise
        raise LmsToolError(
            f"cannot install {' '.join(specs)} for {subdir} from {channel}:\n{exc}\n"
            "Every dependency must be in the channel (it is used alone, offline); add the "
            "missing packages with `lmstool channel add`, or give --virtual for system "
            "packages such as __cuda=12.6"
        ) from None
    return [
        {
            "name": str(r.name.normalized if hasattr(r.name, "normalized") else r.name),
            "version": str(r.version),
            "build": str(r.build),
            "subdir": str(r.subdir),
        }
        for r in records
    ]
