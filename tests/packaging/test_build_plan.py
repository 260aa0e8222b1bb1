"""`lmstool build`: argument checks, the dry-run plan, preflight and resumable execution."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from lmstool import naming, plan, preflight
from lmstool import steps as runner
from lmstool.cli import main
from lmstool.errors import LmsToolError
from lmstool.matrix import Matrix, load_matrix

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_every_step_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    code, out, _ = run_cli(
        capsys,
        "build",
        "v2.6.0",
        "--arch",
        "x86_64",
        "--cuda",
        "12.6",
        "--python",
        "3.11",
        "--work",
        str(work),
        "--max-jobs",
        "8",
        "--dry-run",
    )
    assert code == 0
    bdir = work.resolve() / "build" / "v2.6.0-x86_64-cu126-py3.11"
    for stem in (
        "01-checkout",
        "02-apply",
        "03-buildenv",
        "04-wheel",
        "05-repair",
        "06-conda",
        "07-channel",
        "08-testenv",
        "09-regression",
    ):
        assert f"{stem}:" in out
        assert f"log: {bdir / 'logs' / stem}.log" in out
    assert f"checkout v2.6.0 --dest {bdir / 'pytorch'}" in out
    assert f"apply v2.6.0 --tree {bdir / 'pytorch'}" in out
    assert "setup.py bdist_wheel" in out
    for env in (
        "USE_CUDA=1",
        "USE_CUDNN=1",
        "USE_NCCL=1",
        "BUILD_TEST=0",
        "MAX_JOBS=8",
        "TORCH_CUDA_ARCH_LIST=5.0;6.0;7.0;7.5;8.0;8.6;9.0",
        "PYTORCH_BUILD_VERSION=2.6.0+lms.cu126",
        "USE_MKLDNN=1",
    ):
        assert f"env: {env}" in out
    assert "auditwheel repair --plat manylinux_2_28_x86_64" in out
    assert "--exclude 'libcuda.so.*'" in out
    assert f"out: {bdir / 'pytorch/dist/torch-2.6.0+lms.cu126-cp311-cp311-linux_x86_64.whl'}" in out
    assert "wheelhouse/torch-2.6.0+lms.cu126-cp311-cp311-manylinux_2_28_x86_64.whl" in out
    assert "channel/linux-64/pytorch-2.6.0-py311_cu126_lms_0.conda" in out
    assert "-m pytest tests/regression" in out
    assert not work.exists(), "a dry run must not create anything"


@pytest.mark.parametrize("tag", [t.name for t in load_matrix(REPO_ROOT).tags_with_series()])
def test_dry_run_of_every_tag_uses_its_own_toolchain(
    tag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan of each tag with a series, on each architecture: by default its newest CUDA
    and the running Python if the tag supports it (else its newest), its CUDA's arch list, its
    version in the wheel and the conda package; a Python outside its range is refused."""
    matrix = load_matrix(REPO_ROOT)
    config = matrix.get_tag(tag)
    work = tmp_path / "work"
    for arch in naming.ARCHES:
        running = f"{sys.version_info.major}.{sys.version_info.minor}"
        python = running if running in config.python else config.python[-1]
        cuda = config.cudas(arch)[-1]
        code, out, err = run_cli(
            capsys, "build", tag, "--arch", arch, "--work", str(work), "--dry-run"
        )
        assert code == 0, err
        assert (
            f"Build plan for {tag} ({config.version}) on {arch}, CUDA {cuda}, Python {python}"
            in out
        )
        cu, py = cuda.replace(".", ""), python.replace(".", "")
        assert f"env: PYTORCH_BUILD_VERSION={config.version}+lms.cu{cu}" in out
        assert f"env: TORCH_CUDA_ARCH_LIST={matrix.cuda_info(cuda).arch_list[arch]}" in out
        assert f"apply {tag} --tree" in out and f"python{python} -m venv" in out
        assert f"pytorch-{config.version}-py{py}_cu{cu}_lms_0.conda" in out
        outside = [p for p in ("3.6", "3.14") if p not in config.python]
        code, _, err = run_cli(
            capsys, "build", tag, "--arch", arch, "--python", outside[0], "--work", str(work),
            "--dry-run",
        )  # fmt: skip
        assert code == 2 and f"Python {outside[0]} is not supported by {tag}" in err
    assert not work.exists(), "a dry run must not create anything"


def test_dry_run_ppc64le(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "build",
        "v2.6.0",
        "--arch",
        "ppc64le",
        "--cuda",
        "12.4",
        "--python",
        "3.12",
        "--work",
        str(tmp_path),
        "--dry-run",
        "--skip-tests",
    )
    assert code == 0
    assert "env: USE_MKLDNN=0" in out and "env: USE_FBGEMM=0" in out
    assert "env: TORCH_CUDA_ARCH_LIST=6.0;7.0;8.0" in out
    assert "env: PYTORCH_BUILD_VERSION=2.6.0+lms.cu124" in out
    assert "--plat manylinux_2_28_ppc64le" in out
    assert "channel/linux-ppc64le/pytorch-2.6.0-py312_cu124_lms_0.conda" in out
    assert "regression" not in out


def test_dry_run_warns_that_orig_tarball_cannot_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "pytorch_2.6.0+dfsg.orig.tar.xz").write_bytes(b"")
    code, out, _ = run_cli(
        capsys,
        "build",
        "v2.6.0",
        "--arch",
        "x86_64",
        "--cuda",
        "12.6",
        "--python",
        "3.11",
        "--work",
        str(tmp_path / "w"),
        "--sources",
        str(sources),
        "--dry-run",
    )
    assert code == 0
    assert f"--sources {sources}" in out
    assert "Preflight will stop this build" in out
    assert "use a git checkout with submodules" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arch", "ppc64le", "--cuda", "12.6"], "last ppc64le toolkit is 12.4"),
        (["--arch", "x86_64", "--cuda", "13.0"], "newer than v2.6.0 supports on x86_64"),
        (["--arch", "x86_64", "--cuda", "12.1"], "pass --cuda 11.8 or --cuda 12.4 or --cuda 12.6"),
        (["--arch", "x86_64", "--python", "3.8"], "Python 3.8 is not supported by v2.6.0"),
        (["--arch", "arm64"], "pass --arch x86_64 or ppc64le"),
        (["--arch", "x86_64", "--max-jobs", "0"], "MAX_JOBS must be at least 1"),
    ],
)
def test_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run_cli(capsys, "build", "v2.6.0", *args, "--work", str(tmp_path), "--dry-run")
    assert code == 2
    assert message in err
    assert out == ""


def test_missing_python_exe_is_refused_by_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PYTHON_EXE that is not there is refused before a plan is shown, even a dry run's."""
    bindir = tmp_path / "bin"
    exe = bindir / "python2"
    args = ("build", "v2.6.0", "--arch", "x86_64", "--python", "3.11", "--dry-run")
    args += ("--work", str(tmp_path / "w"))
    code, out, err = run_cli(capsys, *args, "--python-exe", str(exe))
    assert code == 2 and out == ""
    assert f"--python-exe {exe} names no interpreter: {exe} does not exist" in err
    assert "Pass --python-exe PATH naming a Python 3.11 interpreter" in err
    assert "leave out --python-exe to use python3.11" in err
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")  # there, but not executable
    code, out, err = run_cli(capsys, *args, "--python-exe", str(exe))
    assert code == 2 and "is not executable" in err
    monkeypatch.setenv("PATH", str(bindir))
    code, out, err = run_cli(capsys, *args, "--python-exe", "python3.11")
    assert code == 2 and "there is no command python3.11 on PATH" in err
    monkeypatch.setenv("LMSTOOL_FRONTEND", "make")
    code, out, err = run_cli(capsys, *args, "--python-exe", str(exe))
    assert code == 2 and f"PYTHON_EXE={exe} names no interpreter" in err
    assert "leave out PYTHON_EXE= to use python3.11" in err and "--python-exe" not in err
    # An executable file, or a command on PATH, makes the build's environments.
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    for given in (str(exe), "python2"):
        code, out, err = run_cli(capsys, *args, "--python-exe", given)
        assert code == 0, err
        assert f"sh -c '{given} -m venv" in out
    assert not (tmp_path / "w").exists(), "a dry run must not create anything"


def test_unknown_tag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "build", "v0.0.1", "--work", str(tmp_path), "--dry-run")
    assert code == 2
    assert "unknown tag 'v0.0.1'" in err and "v2.6.0" in err


def _fake_tool(folder: Path, name: str, output: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text(f"#!/bin/sh\necho '{output}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tool


def _config(matrix: Matrix, tmp_path: Path, **kw: object) -> plan.BuildConfig:
    args: dict[str, object] = {
        "tag": "v2.6.0",
        "arch": "x86_64",
        "cuda": "12.6",
        "python": "3.11",
        "work": tmp_path / "work",
        "max_jobs": 1,
        "python_exe": sys.executable,
    }
    args.update(kw)
    return plan.make_config(matrix, **args)  # type: ignore[arg-type]


def _by_check(findings: list[preflight.Finding]) -> dict[str, preflight.Finding]:
    return {f.check: f for f in findings}


def test_preflight_host_checks(matrix: Matrix, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    gcc11 = _fake_tool(bindir, "gcc11", "11.4.0")
    gcc14 = _fake_tool(bindir, "gcc14", "14.1.0")
    _fake_tool(
        tmp_path / "cuda126" / "bin", "nvcc", "Cuda compilation tools, release 12.6, V12.6.85"
    )
    _fake_tool(
        tmp_path / "cuda130" / "bin", "nvcc", "Cuda compilation tools, release 13.0, V13.0.1"
    )
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    cfg = _config(matrix, tmp_path, python=py if py in matrix.get_tag("v2.6.0").python else "3.11")

    good = {"CC": str(gcc11), "CUDA_HOME": str(tmp_path / "cuda126")}
    found = _by_check(preflight.preflight(cfg, matrix, good, host="x86_64"))
    assert found["compiler"].ok and found["cuda"].ok and found["architecture"].ok
    assert found["submodules"].ok

    bad = {"CC": str(gcc14), "CUDA_HOME": str(tmp_path / "cuda130")}
    found = _by_check(preflight.preflight(cfg, matrix, bad, host="ppc64le"))
    assert not found["compiler"].ok and "outside 9-13" in found["compiler"].message
    assert not found["cuda"].ok and "CUDA 13.0" in found["cuda"].message
    assert "CUDA_HOME" in found["cuda"].fix
    assert not found["architecture"].ok and "Dockerfile.x86_64" in found["architecture"].fix

    missing = {"CC": str(tmp_path / "nope"), "CUDA_HOME": str(tmp_path / "nocuda")}
    found = _by_check(preflight.preflight(cfg, matrix, missing, host="x86_64"))
    assert not found["compiler"].ok and not found["cuda"].ok


def test_preflight_cuda11_caps_gcc(matrix: Matrix, tmp_path: Path) -> None:
    gcc12 = _fake_tool(tmp_path / "bin", "gcc", "12.2.0")
    cfg = _config(matrix, tmp_path, cuda="11.8")
    found = _by_check(preflight.preflight(cfg, matrix, {"CC": str(gcc12)}, host="x86_64"))
    assert not found["compiler"].ok and "9-11" in found["compiler"].message


def test_preflight_memory_suggests_max_jobs(matrix: Matrix, tmp_path: Path) -> None:
    if preflight.mem_available_gib() is None:
        pytest.skip("no /proc/meminfo on this system")
    cfg = _config(matrix, tmp_path, max_jobs=100000)
    found = _by_check(preflight.preflight(cfg, matrix, {}, host="x86_64"))
    assert not found["memory"].ok
    assert found["memory"].fix.startswith("pass MAX_JOBS=")


def test_preflight_python_mismatch(
    matrix: Matrix, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = "3.9" if sys.version_info[:2] != (3, 9) else "3.10"
    cfg = _config(matrix, tmp_path, python=other)
    found = _by_check(preflight.preflight(cfg, matrix, {}, host="x86_64"))
    assert not found["python"].ok and "--python-exe" in found["python"].fix
    # Under make the fix names the make variables instead.
    monkeypatch.setenv("LMSTOOL_FRONTEND", "make")
    found = _by_check(preflight.preflight(cfg, matrix, {}, host="x86_64"))
    assert "PYTHON_EXE=PATH" in found["python"].fix and "--python-exe" not in found["python"].fix


def test_preflight_tree_without_submodules(matrix: Matrix, tmp_path: Path) -> None:
    cfg = _config(matrix, tmp_path)
    cfg.tree.mkdir(parents=True)
    (cfg.tree / "setup.py").write_text("")
    for name in matrix.get_tag("v2.6.0").submodules_for("x86_64")[1:]:
        (cfg.tree / "third_party" / name).mkdir(parents=True)
        (cfg.tree / "third_party" / name / "CMakeLists.txt").write_text("")
    found = _by_check(preflight.preflight(cfg, matrix, {}, host="x86_64"))
    assert not found["submodules"].ok
    assert found["submodules"].message.endswith("lacks pybind11")
    assert "submodule update --init --recursive" in found["submodules"].fix


def test_full_build_from_orig_tarball_stops_at_preflight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], repo: Path
) -> None:
    sources = Path(os.environ.get("LMS_SOURCES", "").strip() or tmp_path / "none")
    if not (sources / "pytorch_2.6.0+dfsg.orig.tar.xz").exists():
        sources = tmp_path / "sources"
        sources.mkdir()
        (sources / "pytorch_2.6.0+dfsg.orig.tar.xz").write_bytes(b"")
    work = tmp_path / "work"
    code, out, err = run_cli(
        capsys,
        "build",
        "v2.6.0",
        "--arch",
        naming.host_arch() if naming.host_arch() in naming.ARCHES else "x86_64",
        "--cuda",
        "12.4",
        "--python",
        "3.11",
        "--work",
        str(work),
        "--sources",
        str(sources),
    )
    assert code == 2
    assert "source tarball without the third_party submodules" in out
    assert "fix: use a git checkout with submodules" in out
    assert "nothing was built" in err
    logs = sorted(p.name for p in (work / "build").glob("*/logs/*"))
    assert logs == ["00-preflight.log"], "no step may run after a failed preflight"


def _steps(tmp_path: Path, marker: str = "a") -> list[runner.Step]:
    out = tmp_path / "out"
    py = sys.executable

    def write(name: str, text: str) -> list[str]:
        target = str(out / name)
        code = (
            f"import pathlib; pathlib.Path({target!r}).write_text({text!r}); print('wrote {name}')"
        )
        return [py, "-c", code]

    out.mkdir(exist_ok=True)
    return [
        runner.Step("one", "first", write("one.txt", marker), tmp_path, outputs=[out / "one.txt"]),
        runner.Step(
            "two",
            "second",
            write("two.txt", "b"),
            tmp_path,
            env={"LMS_X": "1"},
            outputs=[out / "two.txt"],
        ),
        runner.Step("three", "third", write("three.txt", "c"), tmp_path),
    ]


def test_execute_logs_stamps_and_resumes(matrix: Matrix, tmp_path: Path) -> None:
    cfg = _config(matrix, tmp_path)
    steps = _steps(tmp_path)
    out = io.StringIO()
    runner.execute(cfg, steps, out=out)
    assert "[1/3] one: first" in out.getvalue() and "[3/3] three: ok in" in out.getvalue()
    log = (cfg.logs / "02-two.log").read_text()
    assert "# env: LMS_X=1" in log and "wrote two.txt" in log
    stamp = json.loads((cfg.stamps / "01-one.done").read_text())
    assert stamp["key"] == runner.step_keys(steps)[0]

    out = io.StringIO()
    runner.execute(cfg, steps, out=out)
    assert out.getvalue().count("done earlier, skipped") == 3
    assert "done, skipped on rerun" in plan.format_plan(cfg, steps)

    # A changed input redoes that step and everything after it.
    (tmp_path / "out" / "three.txt").unlink()
    changed = _steps(tmp_path, marker="z")
    out = io.StringIO()
    runner.execute(cfg, changed, out=out)
    assert "skipped" not in out.getvalue()
    assert (tmp_path / "out" / "one.txt").read_text() == "z"
    assert (tmp_path / "out" / "three.txt").exists()

    # A missing output also redoes the step.
    (tmp_path / "out" / "two.txt").unlink()
    out = io.StringIO()
    runner.execute(cfg, changed, out=out)
    assert "[1/3] one: done earlier" in out.getvalue()
    assert "[2/3] two: ok" in out.getvalue() and "[3/3] three: ok" in out.getvalue()


def test_execute_failure_reports_log_tail(matrix: Matrix, tmp_path: Path) -> None:
    cfg = _config(matrix, tmp_path)
    steps = _steps(tmp_path)
    steps[1] = runner.Step(
        "two",
        "fails",
        [sys.executable, "-c", "print('compiler exploded'); raise SystemExit(3)"],
        tmp_path,
    )
    with pytest.raises(LmsToolError) as info:
        runner.execute(cfg, steps, out=io.StringIO())
    text = str(info.value)
    assert "step two failed with exit code 3" in text
    assert "compiler exploded" in text and str(cfg.logs / "02-two.log") in text
    assert (cfg.stamps / "01-one.done").exists()
    assert not (cfg.stamps / "02-two.done").exists()
    assert not (cfg.stamps / "03-three.done").exists()


def test_step_keys_follow_series_content(matrix: Matrix, tmp_path: Path) -> None:
    cfg = _config(matrix, tmp_path)
    keys = runner.step_keys(plan.plan(cfg, matrix))
    cfg2 = _config(matrix, tmp_path, max_jobs=4)
    keys2 = runner.step_keys(plan.plan(cfg2, matrix))
    # MAX_JOBS changes the wheel step: the steps before it keep their stamps.
    assert keys[:3] == keys2[:3] and keys[3] != keys2[3]
    assert len(set(keys)) == len(keys)
    assert os.environ.get("LMS_X") is None


def _project_with_one_series(root: Path) -> tuple[Path, str, list[str]]:
    """A project checkout (config/ of this one) where only the default tag has a series."""
    real = load_matrix(REPO_ROOT)
    shutil.copytree(REPO_ROOT / "config", root / "config")
    series = real.get_tag(real.default_tag).series_file(root)
    series.parent.mkdir(parents=True)
    series.write_text("0001-engine.engine c10/cuda\n")
    others = [name for name in real.tags if name != real.default_tag]
    assert others, "the matrix lists more than one tag"
    return root, real.default_tag, others


def test_tag_without_series_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project, with_series, source_only = _project_with_one_series(tmp_path / "project")
    work = tmp_path / "work"
    for tag in source_only:
        args = ("--repo", str(project), "build", tag, "--work", str(work))
        code, out, err = run_cli(capsys, *args, "--preflight")
        assert code == 2 and out == ""
        assert f"{tag} has no LMS series" in err and f"integration/{tag}/series" in err
        assert f"Use {with_series}, or port" in err
        assert not work.exists(), "nothing may run for a tag without a series"
        monkeypatch.setenv("LMSTOOL_FRONTEND", "make")
        code, _, err = run_cli(capsys, *args, "--dry-run")
        assert code == 2 and f"Use TAG={with_series}, or port" in err
        monkeypatch.delenv("LMSTOOL_FRONTEND")


def test_submodule_fix_names_make_variables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "pytorch_2.6.0+dfsg.orig.tar.xz").write_bytes(b"")
    monkeypatch.setenv("LMSTOOL_FRONTEND", "make")
    args = ("build", "v2.6.0", "--arch", "x86_64", "--work", str(tmp_path / "w"), "--dry-run")
    code, out, _ = run_cli(capsys, *args, "--sources", str(sources))
    assert code == 0
    assert f"run again without SOURCES={sources}" in out and "MIRROR=PATH" in out
    assert "`PREFLIGHT=1` checks this host" in out and "--preflight" not in out
    assert "--sources" not in out.split("Preflight will stop this build")[1]
    # The default (no SOURCES) clones from GitHub with the submodules: nothing to stop.
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and "Preflight will stop" not in out
    assert "--sources" not in out and "checkout v2.6.0 --dest" in out
