"""Preflight: check the build host before hours of work.

Arguments against the tag's matrix, compiler, CUDA toolkit, Python, disk, memory and the
third_party submodules. Every failed finding carries its fix, spelled as the user can type it
(a make variable under make, an option otherwise).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmstool.errors import LmsToolError
from lmstool.hints import option
from lmstool.matrix import Matrix, Tarball
from lmstool.naming import host_arch, version_tuple
from lmstool.plan import BuildConfig


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


def _tarball_without_submodules(matrix: Matrix, cfg: BuildConfig) -> Tarball | None:
    """The tag's tarball found in SOURCES when it lacks the submodules (the one checkout uses)."""
    if cfg.sources is None or cfg.remote is not None or cfg.mirror is not None:
        return None
    for tarball in matrix.get_tag(cfg.tag).source.tarballs:
        if (cfg.sources / tarball.name).exists():
            return None if tarball.submodules else tarball
    return None


def preflight(
    cfg: BuildConfig,
    matrix: Matrix,
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
                f"this host is {host} but the build is for {cfg.arch}; PyTorch does not "
                f"cross-compile",
                f"build on a {cfg.arch} host or in recipes/containers/Dockerfile.{cfg.arch}, "
                f"or pass {option('arch', host)}",
            )
        )

    findings.extend(source_findings(cfg, matrix))
    findings.extend(_host_findings(cfg, matrix, env))
    return findings


def source_findings(cfg: BuildConfig, matrix: Matrix) -> list[Finding]:
    """Checks of the sources that read files only (the dry run shows them too)."""
    findings: list[Finding] = []
    # Sources: Debian orig tarballs carry no third_party submodules.
    tarball = _tarball_without_submodules(matrix, cfg)
    required = matrix.get_tag(cfg.tag).submodules_for(cfg.arch)
    if tarball is not None:
        assert cfg.sources is not None
        findings.append(
            Finding(
                False,
                "submodules",
                f"{cfg.sources / tarball.name} is a source tarball without the third_party "
                f"submodules ({', '.join(required[:5])}, ...); a full PyTorch build needs them",
                f"use a git checkout with submodules: run again without "
                f"{option('sources', str(cfg.sources))}, so the checkout step clones {cfg.tag} "
                f"from {matrix.github_remote} with its submodules (needs network), or pass "
                f"{option('mirror', 'PATH')} with a local clone that has them",
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


def _host_findings(cfg: BuildConfig, matrix: Matrix, env: Mapping[str, str]) -> list[Finding]:
    findings: list[Finding] = []
    # Compiler: the tag's range, and no newer than this CUDA's nvcc accepts.
    cc = env.get("CC", "gcc")
    gcc_range = matrix.get_tag(cfg.tag).gcc
    if gcc_range is None:
        raise LmsToolError(f"{matrix.toolchain.path} has no gcc range for {cfg.tag}; add one")
    max_gcc = min(gcc_range.max, matrix.cuda_info(cfg.cuda).max_gcc)
    gcc = gcc_version(cc)
    if gcc is None:
        findings.append(
            Finding(
                False,
                "compiler",
                f"no working C compiler {cc!r}",
                f"install gcc {gcc_range.min}-{max_gcc} (for example gcc-toolset-11 on "
                "RHEL/UBI 8) and set CC/CXX",
            )
        )
    else:
        major = version_tuple(gcc)[0]
        if gcc_range.min <= major <= max_gcc:
            findings.append(Finding(True, "compiler", f"{cc} {gcc}"))
        else:
            findings.append(
                Finding(
                    False,
                    "compiler",
                    f"{cc} {gcc} is outside {gcc_range.min}-{max_gcc}, the gcc range {cfg.tag} "
                    f"builds with and CUDA {cfg.cuda}'s nvcc accepts",
                    f"install gcc {gcc_range.min}-{max_gcc} and set CC and CXX to it",
                )
            )

    # CUDA toolkit: the installed nvcc must be the CUDA the build was asked for.
    nvcc = find_nvcc(env)
    found = nvcc_version(nvcc)
    listed = ", ".join(matrix.get_tag(cfg.tag).cudas(cfg.arch))
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
                f"set CUDA_HOME to a CUDA {cfg.cuda} toolkit"
                + (
                    f", or pass {option('cuda', found)} to build for the installed one"
                    if found in matrix.get_tag(cfg.tag).cudas(cfg.arch)
                    else f" ({cfg.tag} does not support the installed CUDA {found})"
                ),
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
                f"install Python {cfg.python}, or pass {option('python_exe', 'PATH')} naming a "
                f"Python {cfg.python} interpreter",
            )
        )
    elif out.strip() != cfg.python:
        findings.append(
            Finding(
                False,
                "python",
                f"{cfg.python_exe} is Python {out.strip()}, not {cfg.python}",
                f"pass {option('python_exe', 'PATH')} naming a Python {cfg.python} interpreter, "
                f"or {option('python', out.strip())} to build for the Python found",
            )
        )
    else:
        findings.append(Finding(True, "python", f"{cfg.python_exe} is Python {cfg.python}"))

    # Disk and memory.
    need_disk = matrix.toolchain.min_disk_gib
    free = shutil.disk_usage(_nearest_existing(cfg.work)).free / 2**30
    if free >= need_disk:
        findings.append(Finding(True, "disk", f"{free:.0f} GiB free under {cfg.work}"))
    else:
        findings.append(
            Finding(
                False,
                "disk",
                f"{free:.1f} GiB free under {cfg.work}; a CUDA build needs {need_disk:.0f} GiB",
                f"free space, or pass {option('work', 'DIR')} on a larger file system",
            )
        )
    per_job = matrix.toolchain.gib_per_job
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
