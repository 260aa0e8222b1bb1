"""CUDA torch wheels as build inputs of the drop-in: found, downloaded once, unpacked in part.

The drop-in is compiled against a torch release's headers and linked against its libraries,
both of which a torch wheel carries; nothing here imports torch, so the wheel may be for
another Python than the one running lmstool (the headers and libraries are the same in
every Python's wheel of one release). Wheels are looked for, in order, in the cache
(``$LMS_TORCH_WHEELS``, default ``~/.cache/torch-lms/torch-wheels``), in the local folders
pip is configured with (find-links and ``file://`` indexes), and only then downloaded from
the package index with pip into the cache, once.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from lmstool.errors import LmsToolError

log = logging.getLogger(__name__)

CACHE_ENV = "LMS_TORCH_WHEELS"
_VERSION_LINE = re.compile(r"""^__version__\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.M)
_CUDA_LINE = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*(None|['"]([^'"]*)['"])""", re.M)
_CXX_STANDARD = re.compile(r"CXX_STANDARD\s+(\d+)")
_WHEEL = re.compile(r"^torch-(?P<version>[^-]+)-(?P<py>cp\d+)-[^-]+-(?P<plat>[^-]+)\.whl$")
VERSION_PY = "torch/version.py"
TORCH_CONFIG = "torch/share/cmake/Torch/TorchConfig.cmake"
# The libraries the drop-in links (torch's cpp_extension links the same for a CUDA
# extension, less libtorch.so, a linker script of torch_cpu and torch_cuda it does not use).
LINK_LIBRARIES = ("c10", "c10_cuda", "torch_cpu", "torch_python")


def default_cache() -> Path:
    configured = os.environ.get(CACHE_ENV, "").strip()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "torch-lms" / "torch-wheels"


@dataclass(frozen=True)
class TorchWheel:
    """A torch wheel and what it says of itself (torch/version.py, TorchConfig.cmake)."""

    path: Path
    version: str  # e.g. 2.11.0+cu130
    cuda: str | None  # e.g. 13.0; None for a CPU build
    cxx_standard: int  # the C++ standard its headers need (TorchConfig.cmake)

    @property
    def release(self) -> str:
        match = re.match(r"\d+\.\d+\.\d+", self.version)
        return match[0] if match else self.version


def read_wheel(path: Path) -> TorchWheel:
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if VERSION_PY not in names:
                raise LmsToolError(f"{path.name} has no {VERSION_PY}: it is not a torch wheel")
            version_py = archive.read(VERSION_PY).decode()
            config = archive.read(TORCH_CONFIG).decode() if TORCH_CONFIG in names else ""
    except (OSError, zipfile.BadZipFile) as exc:
        raise LmsToolError(f"{path} is not a readable wheel ({exc})") from None
    found = _VERSION_LINE.search(version_py)
    if found is None:
        raise LmsToolError(f"{path.name}: {VERSION_PY} names no __version__")
    cuda = _CUDA_LINE.search(version_py)
    standard = _CXX_STANDARD.search(config)
    return TorchWheel(
        path=path,
        version=found[1],
        cuda=None if cuda is None or cuda[1] == "None" else cuda[2],
        # Releases before CXX_STANDARD was written into TorchConfig.cmake built as C++17.
        cxx_standard=int(standard[1]) if standard else 17,
    )


def _pip_config() -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    values: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    return values


def local_folders() -> list[Path]:
    """Folders of wheels on this machine that pip is configured with: its find-links and the
    file:// indexes (their wheels lie beside the simple/ pages, in files/ or the index)."""
    config = _pip_config()
    folders: list[Path] = []
    for key in ("find-links",):
        for item in shlex.split(config.get(key, "")):
            path = Path(unquote(urlparse(item).path)) if "://" in item else Path(item)
            if path.is_dir():
                folders.append(path)
    for key in ("index-url", "extra-index-url"):
        for item in shlex.split(config.get(key, "")):
            url = urlparse(item)
            if url.scheme != "file":
                continue
            simple = Path(unquote(url.path))
            for candidate in (simple / "torch", simple.parent / "files", simple):
                if candidate.is_dir():
                    folders.append(candidate)
    return folders


def _candidates(folder: Path, release: str) -> list[Path]:
    found = []
    for path in sorted(folder.glob(f"torch-{release}*.whl")):
        match = _WHEEL.match(path.name)
        if match and match["version"].split("+")[0] == release and "x86_64" in match["plat"]:
            found.append(path)
    return found


def find_local(
    release: str, cuda: str | None, folders: list[Path], *, allow_cpu: bool = False
) -> TorchWheel | None:
    """A wheel of torch ``release`` in ``folders``: the CUDA build of ``cuda`` (any CUDA build
    when ``cuda`` is None), or, with ``allow_cpu``, a CPU build when no CUDA build is there."""
    cpu: TorchWheel | None = None
    for folder in folders:
        for path in _candidates(folder, release):
            try:
                wheel = read_wheel(path)
            except LmsToolError as exc:
                log.warning("skipping %s: %s", path, exc)
                continue
            if wheel.release != release:
                continue
            if wheel.cuda is None:
                cpu = cpu or wheel
            elif cuda is None or wheel.cuda == cuda:
                return wheel
    return cpu if allow_cpu else None


def download(release: str, cache: Path, *, python: str | None = None) -> Path:
    """``pip download`` torch ``release`` (the index's default build) into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "off",
            "--dest",
            tmp,
            f"torch=={release}",
        ]
        if python:
            cmd += ["--python-version", python, "--platform", "manylinux_2_28_x86_64"]
        log.info("downloading torch %s once into %s: %s", release, cache, " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("torch-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise LmsToolError(
                f"pip could not download torch=={release}:\n{proc.stderr.strip()[-2000:]}\n"
                f"Put a torch {release} wheel into {cache} (or pass --torch-wheel PATH)"
            )
        target = cache / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


def locate(
    release: str,
    cuda: str | None,
    *,
    cache: Path | None = None,
    allow_download: bool = True,
    allow_cpu: bool = False,
    python: str | None = None,
) -> TorchWheel:
    """The torch ``release`` wheel for CUDA ``cuda`` from the cache, local folders, or the
    index (downloaded once into the cache). Errors say what was looked for and where."""
    cache = cache or default_cache()
    folders = [cache, *local_folders()]
    found = find_local(release, cuda, folders, allow_cpu=allow_cpu)
    if found is not None:
        return found
    where = ", ".join(str(f) for f in folders)
    if not allow_download:
        raise LmsToolError(
            f"no torch {release} wheel{f' for CUDA {cuda}' if cuda else ''} in {where}, and "
            "downloads are off: allow them (--download) or put the wheel into "
            f"{cache} (${CACHE_ENV})"
        )
    wheel = read_wheel(download(release, cache, python=python))
    if wheel.release != release or (cuda is not None and wheel.cuda != cuda):
        built = f"CUDA {wheel.cuda}" if wheel.cuda else "CPU-only"
        raise LmsToolError(
            f"the index's torch {release} wheel ({wheel.path.name}) is {built}, not CUDA "
            f"{cuda}: pass --torch-wheel with a CUDA {cuda} build (PyTorch's own index has one "
            "per CUDA version), or --cuda " + (wheel.cuda or "of a CUDA build")
        )
    return wheel


def unpack(wheel: TorchWheel, dest_root: Path, *, libraries: bool) -> Path:
    """Unpack the headers (and, with ``libraries``, the libraries the drop-in links) of
    ``wheel`` under ``dest_root``; return the folder holding ``torch/``. Kept between runs."""
    label = wheel.cuda.replace(".", "") if wheel.cuda else "cpu"
    dest = dest_root / f"torch-{wheel.release}-{label}"
    parts = ["headers", *(["libraries"] if libraries else [])]
    stamps = {part: dest / f".unpacked-{part}" for part in parts}
    if all(stamp.is_file() and stamp.read_text() == wheel.path.name for stamp in stamps.values()):
        return dest
    wanted_libs = {f"torch/lib/lib{name}.so" for name in LINK_LIBRARIES}
    with zipfile.ZipFile(wheel.path) as archive:
        for member in archive.infolist():
            name = member.filename
            header = name.startswith("torch/include/") or name in (VERSION_PY, TORCH_CONFIG)
            if not (header or (libraries and name in wanted_libs)) or member.is_dir():
                continue
            if ".." in Path(name).parts or name.startswith("/"):
                raise LmsToolError(f"{wheel.path.name} holds an unsafe path {name!r}")
            archive.extract(member, dest)
    for stamp in stamps.values():
        stamp.write_text(wheel.path.name)
    return dest
