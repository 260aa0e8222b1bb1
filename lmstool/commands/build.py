"""``lmstool build``: the full LMS build of one tag (lmstool.plan, .preflight, .steps)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmstool import plan, preflight, steps
from lmstool.errors import LmsToolError
from lmstool.hints import option
from lmstool.matrix import load_matrix


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "build",
        help="check out a tag, apply the LMS series, build wheel and conda package, run tests",
        description=(
            "Check out TAG, apply its LMS series, build the wheel with PyTorch's setup.py, "
            "repair it with auditwheel, package it for conda, index the channel and run the "
            "regression suite. Preflight checks the host first. Logs go to "
            "WORK/build/<tag>-<arch>-cu<cuda>-py<python>/logs/; a rerun resumes after the "
            "last finished step."
        ),
    )
    parser.add_argument(
        "tag", nargs="?", help="release tag (default: config/tags.yaml's default_tag)"
    )
    parser.add_argument("--arch", help="x86_64 or ppc64le (default: this host)")
    parser.add_argument("--cuda", help="CUDA version, e.g. 12.6 (default: newest the tag supports)")
    parser.add_argument("--python", help="Python X.Y the wheel is for (default: this Python)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--sources",
        type=Path,
        help="folder holding the tag's release tarball (default: clone from GitHub); a "
        "tarball without the submodules cannot build PyTorch and preflight says so",
    )
    source.add_argument("--remote", metavar="URL", help="git remote to clone the tag from")
    source.add_argument("--mirror", type=Path, metavar="PATH", help="local clone to use")
    parser.add_argument(
        "--work", type=Path, default=Path("work"), help="work folder (default: %(default)s)"
    )
    parser.add_argument("--max-jobs", type=int, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--build-number", type=int, default=0, help="conda build number")
    parser.add_argument("--cuda-arch-list", help="override TORCH_CUDA_ARCH_LIST")
    parser.add_argument(
        "--python-exe",
        help="interpreter that makes the build venv: a path or a command on PATH, which must "
        "exist (default: pythonX.Y, checked by preflight)",
    )
    parser.add_argument("--conda-name", default="pytorch", help="conda package name")
    parser.add_argument(
        "--skip-tests", action="store_true", help="leave out the regression-suite steps"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run", action="store_true", help="print the plan (commands, cwd, env, outputs)"
    )
    mode.add_argument("--preflight", action="store_true", help="run only the preflight checks")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    matrix = load_matrix(Path(args.repo).resolve())
    cfg = plan.make_config(
        matrix,
        tag=args.tag,
        arch=args.arch,
        cuda=args.cuda,
        python=args.python,
        work=args.work,
        sources=args.sources,
        remote=args.remote,
        mirror=args.mirror,
        max_jobs=args.max_jobs,
        build_number=args.build_number,
        cuda_arch_list=args.cuda_arch_list,
        python_exe=args.python_exe,
        conda_name=args.conda_name,
        run_tests=not args.skip_tests,
    )
    build_steps = plan.plan(cfg, matrix)
    if args.dry_run:
        print(plan.format_plan(cfg, build_steps))
        for finding in preflight.source_findings(cfg, matrix):
            if not finding.ok:
                print(f"Preflight will stop this build:\n{finding.render()}")
        print(f"Dry run: nothing was run. `{option('preflight')}` checks this host.")
        return 0
    print(f"lmstool build: {cfg.name} in {cfg.build_dir}", flush=True)
    findings = preflight.preflight(cfg, matrix)
    report = preflight.preflight_report(findings)
    cfg.logs.mkdir(parents=True, exist_ok=True)
    (cfg.logs / "00-preflight.log").write_text(report + "\n", encoding="utf-8")
    print(report, flush=True)
    failed = [f for f in findings if not f.ok]
    if failed:
        raise LmsToolError(
            f"preflight found {len(failed)} problem(s), listed above with their fixes (also in "
            f"{cfg.logs / '00-preflight.log'}); nothing was built"
        )
    if args.preflight:
        print("preflight passed")
        return 0
    steps.execute(cfg, build_steps, out=sys.stdout)
    print(f"lmstool build: done. wheel in {cfg.wheelhouse}, conda package {cfg.conda_file}")
    return 0
