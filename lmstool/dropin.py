"""Prebuilt drop-in packages: torch_lms compiled against a CUDA torch wheel, packed as a wheel.

Nothing here imports torch or needs a GPU: the extension is compiled with the headers of
the torch release's wheel (lmstool.torchwheels) and linked against its libraries and the
CUDA runtime, with the flags torch's own ``cpp_extension`` uses for that release, for a
target Python given by its headers. The wheel is written here rather than by setuptools'
bdist_wheel, which tags a wheel for the Python running it: the target (the GPU machine's
3.12, say) need not exist on the build machine.

Naming (extension/torch_lms/_support.py): ``torch_lms-<torch release>.<serial>+cu<XY>``,
requiring ``torch==<torch release>``, written into ``OUT/cu<XY>/``, one folder per CUDA
build as PyTorch's own indexes are. With ``pip install --no-index --find-links OUT/cu130
torch-lms`` pip's resolver takes the newest package whose torch requirement the installed
torch meets, and cannot replace torch, as it has no index to take another from; with an
index, ``"torch-lms==2.11.0.*"`` names the one for torch 2.11.0.
"""

from __future__ import annotations

import base64
import concurrent.futures
import csv
import hashlib
import importlib.util
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from lmstool import manifest
from lmstool.errors import LmsToolError
from lmstool.torchwheels import LINK_LIBRARIES, TorchWheel

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
EXTENSION = REPO / "extension"
ENGINE = REPO / "engine"
OWN_SOURCES = ("csrc/StockAllocatorBackend.cpp", "csrc/Module.cpp")
# The pure-Python files of the package besides the engine's API modules.
PACKAGE_FILES = ("__init__.py", "_integration.py", "_support.py")
WARNING_FLAGS = ("-Wall", "-Wextra", "-Wno-unused-parameter")
# The torch releases prebuilt packages are made for (`make dropin` builds each): every release
# of the supported minors (_support.SUPPORTED_MINORS) that the package index serves. 2.15 is
# not among them: these machines' pip is capped at torch 2.14.1, so its wheel cannot be had.
RELEASES = ("2.11.0", "2.12.0", "2.12.1", "2.13.0", "2.14.0", "2.14.1")


def newest_per_minor(releases: Sequence[str] = RELEASES) -> list[str]:
    """The newest release of each minor: what the compile check covers by default."""
    newest: dict[str, tuple[int, ...]] = {}
    for release in releases:
        numbers = tuple(int(x) for x in release.split("."))
        key = ".".join(release.split(".")[:2])
        newest[key] = max(newest.get(key, numbers), numbers)
    return [".".join(map(str, v)) for _, v in sorted(newest.items(), key=lambda kv: kv[1])]


def support() -> ModuleType:
    """extension/torch_lms/_support.py, loaded by path (importing torch_lms imports torch)."""
    path = EXTENSION / "torch_lms" / "_support.py"
    spec = importlib.util.spec_from_file_location("torch_lms_support", path)
    if spec is None or spec.loader is None:
        raise LmsToolError(f"{path} is missing: restore extension/ from the project")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_torch_version(version: str, what: str = "--torch") -> str:
    """The release of a supported torch ``version``, or an error naming the supported ones."""
    sup = support()
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise LmsToolError(
            f"{what} {version!r} is not a torch release (X.Y.Z): type, for example, "
            f"{what} {sup.SUPPORTED_MINORS[0]}.0"
        )
    if not sup.is_supported(version):
        raise LmsToolError(
            f"{what} {version}: the drop-in supports torch {sup.supported_text()}, not "
            f"{sup.minor(version)}: type, for example, {what} {sup.SUPPORTED_MINORS[-1]}.0"
        )
    return str(sup.release(version))


def check_cuda_version(cuda: str) -> str:
    if not re.fullmatch(r"\d+\.\d+", cuda):
        raise LmsToolError(f"--cuda {cuda!r} is not a CUDA version (X.Y): type, e.g., --cuda 13.0")
    return cuda


# --------------------------------------------------------------------------------------------
# The target Python: its headers and extension-module suffix


@dataclass(frozen=True)
class PythonTarget:
    version: str  # X.Y
    include_dirs: tuple[Path, ...]
    ext_suffix: str

    @property
    def tag(self) -> str:
        return "cp" + self.version.replace(".", "")


_PATCHLEVEL = re.compile(r"#define\s+PY_(MAJOR|MINOR)_VERSION\s+(\d+)")


def _headers_version(include: Path) -> str | None:
    patchlevel = include / "patchlevel.h"
    if not patchlevel.is_file():
        return None
    found = dict(_PATCHLEVEL.findall(patchlevel.read_text(errors="replace")))
    if "MAJOR" not in found or "MINOR" not in found:
        return None
    return f"{found['MAJOR']}.{found['MINOR']}"


def python_target(
    python: str | None = None,
    include_dirs: Sequence[Path] = (),
    python_exe: str | None = None,
) -> PythonTarget:
    """The Python the module is built for: an interpreter (``python_exe``, default the one
    running), or, for a Python absent here, its version and header folders."""
    if include_dirs:
        if not python:
            raise LmsToolError("--python-include needs --python X.Y: the Python those headers are")
        dirs = tuple(Path(d) for d in include_dirs)
        main = next((d for d in dirs if (d / "Python.h").is_file()), None)
        if main is None:
            raise LmsToolError(
                "no Python.h in " + ", ".join(map(str, dirs)) + ": pass the folder of the "
                f"Python {python} headers (its sysconfig 'include', e.g. /usr/include/python"
                f"{python} on the machine that has it)"
            )
        found = _headers_version(main)
        if found != python:
            raise LmsToolError(
                f"the headers in {main} are Python {found}, not {python}: pass --python {found} "
                f"or the headers of Python {python}"
            )
        # CPython's suffix on Linux x86_64 for a default (GIL) build.
        return PythonTarget(python, dirs, f".cpython-{python.replace('.', '')}-x86_64-linux-gnu.so")
    exe = python_exe or sys.executable
    probe = (
        "import sys, sysconfig; p = sysconfig.get_paths(); "
        "print(f'{sys.version_info[0]}.{sys.version_info[1]}'); print(p['include']); "
        "print(p['platinclude']); print(sysconfig.get_config_var('EXT_SUFFIX'))"
    )
    try:
        proc = subprocess.run([exe, "-c", probe], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise LmsToolError(f"cannot run the Python {exe} ({exc}): pass --python-exe PATH") from None
    version, include, platinclude, suffix = proc.stdout.split("\n")[:4]
    if python and python != version:
        raise LmsToolError(
            f"{exe} is Python {version}, not {python}: pass --python-exe with a Python {python}, "
            f"or --python {python} --python-include DIR with its headers"
        )
    if not (Path(include) / "Python.h").is_file():
        raise LmsToolError(
            f"Python {version} at {exe} has no headers ({include}/Python.h): install its "
            f"development package (e.g. python{version}-dev)"
        )
    dirs = tuple(dict.fromkeys([Path(include), Path(platinclude)]))
    return PythonTarget(version, dirs, suffix)


def cuda_runtime(cuda_home: Path, cuda: str | None) -> tuple[Path, list[Path]]:
    """The CUDA runtime's include folder and library folders; checks the major version."""
    include = cuda_home / "include"
    header = include / "cuda_runtime_api.h"
    if not header.is_file():
        raise LmsToolError(
            f"no CUDA runtime headers at {header}: pass --cuda-home with a CUDA toolkit"
        )
    found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
    if cuda and found:
        major = int(found[1]) // 1000
        if str(major) != cuda.split(".")[0]:
            raise LmsToolError(
                f"the CUDA toolkit at {cuda_home} is CUDA {major}, the torch wheel CUDA {cuda}: "
                f"pass --cuda-home with a CUDA {cuda.split('.')[0]} toolkit"
            )
    libs = [d for d in (cuda_home / "lib64", cuda_home / "lib") if d.is_dir()]
    return include, libs


# --------------------------------------------------------------------------------------------
# Compiling


def sources(engine: Path = ENGINE) -> list[Path]:
    """Every translation unit of the extension: the engine's (the manifest's) and its own."""
    return [
        *(engine / rel for rel in manifest.cxx_sources(engine)),
        *(EXTENSION / rel for rel in OWN_SOURCES),
    ]


def compile_flags(
    torch_root: Path,
    standard: int,
    python: PythonTarget,
    cuda_include: Path,
    *,
    engine: Path = ENGINE,
    extra_includes: Sequence[Path] = (),
    werror: bool = False,
) -> list[str]:
    """g++ flags for one release, as torch's cpp_extension passes them for a CppExtension;
    torch's, CUDA's and Python's headers are system headers, held to no warnings of ours."""
    include = torch_root / "torch" / "include"
    flags = [
        f"-std=c++{standard}",
        "-fPIC",
        "-O2",
        "-DNDEBUG",
        *WARNING_FLAGS,
        *(["-Werror"] if werror else []),
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=_C",
        f"-I{engine}",
        f"-I{engine / 'aten/src'}",
    ]
    for path in (include, include / "torch/csrc/api/include", *extra_includes, cuda_include):
        flags += ["-isystem", str(path)]
    for path in python.include_dirs:
        flags += ["-isystem", str(path)]
    return flags


@dataclass
class CompileResult:
    source: Path
    returncode: int
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _run(cmd: list[str], source: Path) -> CompileResult:
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return CompileResult(source, proc.returncode, time.monotonic() - start, proc.stderr)


def compile_all(
    units: Sequence[Path],
    flags: Sequence[str],
    *,
    obj_dir: Path | None,
    cxx: str,
    jobs: int,
) -> list[CompileResult]:
    """Compile ``units`` to objects in ``obj_dir``, or with ``obj_dir`` None check their
    syntax only (-fsyntax-only: templates instantiated, no code generated)."""
    commands = []
    for unit in units:
        if obj_dir is None:
            cmd = [cxx, *flags, "-fsyntax-only", str(unit)]
        else:
            obj_dir.mkdir(parents=True, exist_ok=True)
            cmd = [cxx, *flags, "-c", str(unit), "-o", str(obj_dir / f"{unit.stem}.o")]
        commands.append((cmd, unit))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda c: _run(*c), commands))


def failures(results: Sequence[CompileResult], root: Path = REPO) -> str:
    lines = []
    for r in results:
        if not r.ok:
            try:
                name = r.source.relative_to(root)
            except ValueError:
                name = r.source
            lines.append(f"{name}:\n{r.output[-6000:]}")
    return "\n\n".join(lines)


def default_cxx() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or "c++"


def cuda_macros_dir(torch_root: Path, scratch: Path) -> list[Path]:
    """CPU wheels ship c10/cuda's headers without the generated cuda_cmake_macros.h; a check
    against one gets the header a CUDA build generates (it only marks a shared-library build)."""
    if (torch_root / "torch/include/c10/cuda/impl/cuda_cmake_macros.h").is_file():
        return []
    target = scratch / "c10/cuda/impl/cuda_cmake_macros.h"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [scratch]


# --------------------------------------------------------------------------------------------
# The wheel


def wheel_version(torch_release: str, cuda: str) -> str:
    sup = support()
    return f"{sup.package_version(torch_release)}+{sup.cuda_label(cuda)}"


def wheel_filename(torch_release: str, cuda: str, python: str, platform: str) -> str:
    tag = "cp" + python.replace(".", "")
    name = support().DIST_NAME.replace("-", "_")
    return f"{name}-{wheel_version(torch_release, cuda)}-{tag}-{tag}-{platform}.whl"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def metadata_text(torch_release: str, cuda: str, python: str) -> str:
    sup = support()
    major, minor = python.split(".")
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {sup.DIST_NAME}",
        f"Version: {wheel_version(torch_release, cuda)}",
        "Summary: Large Model Support (tensor swapping to host memory) for stock PyTorch, "
        f"built for torch {torch_release} with CUDA {cuda.split('.')[0]}",
        "License: BSD-3-Clause",
        f"Requires-Python: >={python},<{major}.{int(minor) + 1}",
        f"Requires-Dist: torch=={torch_release}",
    ]
    return "\n".join(lines) + "\n"


def write_wheel(
    out_dir: Path,
    filename: str,
    files: Mapping[str, bytes],
    metadata: str,
    *,
    license_text: str = "",
    generator: str = "lmstool dropin",
) -> Path:
    """Write a wheel holding ``files`` (archive name -> contents) with its .dist-info."""
    match = re.match(r"^([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl$", filename)
    if match is None:
        raise LmsToolError(f"{filename} is not a wheel file name")
    name, version, py, abi, plat = match.groups()
    dist_info = f"{name}-{version}.dist-info"
    wheel_meta = (
        f"Wheel-Version: 1.0\nGenerator: {generator}\nRoot-Is-Purelib: false\n"
        f"Tag: {py}-{abi}-{plat}\n"
    )
    entries = dict(files)
    entries[f"{dist_info}/METADATA"] = metadata.encode()
    entries[f"{dist_info}/WHEEL"] = wheel_meta.encode()
    if license_text:
        entries[f"{dist_info}/licenses/LICENSE"] = license_text.encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for arcname, data in entries.items():
        writer.writerow([arcname, _record_hash(data), str(len(data))])
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    entries[f"{dist_info}/RECORD"] = record.getvalue().encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / filename
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for arcname, data in entries.items():
            info = zipfile.ZipInfo(arcname, date_time=(2026, 1, 1, 0, 0, 0))
            executable = arcname.endswith(".so")
            info.external_attr = (0o755 if executable else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    tmp.replace(target)
    return target


def build_info_text(torch_version: str, cuda: str, package_version: str) -> str:
    return (
        "# Written by lmstool dropin: the torch this copy of torch_lms was built against.\n"
        f"TORCH_VERSION = {torch_version!r}\n"
        f"CUDA_VERSION = {cuda!r}\n"
        f"PACKAGE_VERSION = {package_version!r}\n"
    )


def package_files(
    module: Path, suffix: str, torch_version: str, cuda: str, engine: Path = ENGINE
) -> dict[str, bytes]:
    """The files of the torch_lms package in the wheel: its Python sources, the engine's API
    modules (torch/cuda/*.py of the engine become torch_lms/*.py, as in setup.py), the
    build record and the compiled module."""
    files: dict[str, bytes] = {}
    for name in PACKAGE_FILES:
        files[f"torch_lms/{name}"] = (EXTENSION / "torch_lms" / name).read_bytes()
    for rel in manifest.engine_files(engine, "torch/cuda"):
        if rel.suffix == ".py":
            files[f"torch_lms/{rel.name}"] = (engine / rel).read_bytes()
    package_version = wheel_version(torch_version, cuda)
    files["torch_lms/_build_info.py"] = build_info_text(
        torch_version, cuda, package_version
    ).encode()
    files[f"torch_lms/_C{suffix}"] = module.read_bytes()
    return files


# --------------------------------------------------------------------------------------------
# One build


@dataclass
class BuildResult:
    wheel: Path
    torch: TorchWheel
    python: PythonTarget
    seconds: float
    glibc: str
    conda: list[Path] = field(default_factory=list)


def _max_glibc(module: Path) -> str:
    """The newest GLIBC symbol version the module needs (what the target's C library must
    provide), read with objdump; empty when objdump is missing."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return ""
    proc = subprocess.run([objdump, "-T", str(module)], capture_output=True, text=True)
    versions = {
        tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_(\d+\.\d+)", proc.stdout)
    }
    return ".".join(map(str, max(versions))) if versions else ""


def build_wheel(
    wheel: TorchWheel,
    torch_root: Path,
    python: PythonTarget,
    out_dir: Path,
    work: Path,
    *,
    cuda_home: Path,
    cxx: str | None = None,
    jobs: int = 2,
    engine: Path = ENGINE,
) -> BuildResult:
    """Compile and link torch_lms against the unpacked ``wheel`` and write its drop-in wheel
    into ``out_dir/cu<XY>/``."""
    if wheel.cuda is None:
        raise LmsToolError(
            f"{wheel.path.name} is a CPU-only build of torch: the drop-in links c10_cuda and "
            "the CUDA runtime; pass the CUDA build's wheel"
        )
    start = time.monotonic()
    cxx = cxx or default_cxx()
    cuda_include, cuda_libs = cuda_runtime(cuda_home, wheel.cuda)
    flags = compile_flags(torch_root, wheel.cxx_standard, python, cuda_include, engine=engine)
    obj_dir = work / "obj"
    results = compile_all(sources(engine), flags, obj_dir=obj_dir, cxx=cxx, jobs=jobs)
    failed = failures(results)
    if failed:
        raise LmsToolError(f"compiling torch_lms against torch {wheel.version} failed:\n{failed}")
    for result in results:
        if "warning:" in result.output:
            log.warning("%s:\n%s", result.source.name, result.output[-4000:])
    module = work / f"_C{python.ext_suffix}"
    torch_lib = torch_root / "torch" / "lib"
    link = [
        cxx,
        "-shared",
        "-o",
        str(module),
        *(str(obj_dir / f"{unit.stem}.o") for unit in sources(engine)),
        f"-L{torch_lib}",
        *(f"-L{d}" for d in cuda_libs),
        "-Wl,--as-needed",
        *(f"-l{name}" for name in LINK_LIBRARIES),
        "-lcudart",
        # The libraries torch_lms needs are loaded by `import torch` before it, and the
        # dynamic loader reuses them by soname; the run paths find them otherwise: torch's
        # libraries, and the CUDA runtime of the nvidia wheels torch depends on.
        "-Wl,-rpath,$ORIGIN/../torch/lib:$ORIGIN/../nvidia/cu"
        + wheel.cuda.split(".")[0]
        + "/lib:$ORIGIN/../nvidia/cuda_runtime/lib",
        # The few symbols of libtorch_cuda it uses (the CUDA generator, cuBLAS workspaces)
        # resolve at load time through libtorch_python's dependencies, as in a source build;
        # libtorch_python's own dependencies are not unpacked, so ld must not look for them.
        "-Wl,--allow-shlib-undefined",
    ]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LmsToolError(f"linking torch_lms failed:\n{proc.stderr[-6000:]}")
    sup = support()
    files = package_files(module, python.ext_suffix, wheel.version, wheel.cuda, engine)
    filename = wheel_filename(wheel.release, wheel.cuda, python.version, "linux_x86_64")
    target_dir = out_dir / sup.cuda_label(wheel.cuda)
    license_path = EXTENSION / "LICENSE"
    built = write_wheel(
        target_dir,
        filename,
        files,
        metadata_text(wheel.release, wheel.cuda, python.version),
        license_text=license_path.read_text() if license_path.is_file() else "",
    )
    return BuildResult(built, wheel, python, time.monotonic() - start, _max_glibc(module))
