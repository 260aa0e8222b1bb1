"""The conda-build recipe renders for every supported variant and agrees with the matrix."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from lmstool import naming, plan, recipe
from lmstool.errors import LmsToolError
from lmstool.matrix import Matrix, load_matrix

pytest.importorskip("jinja2", reason="rendering the recipe needs Jinja2 (pip install Jinja2)")


def variants(matrix: Matrix) -> list[tuple[str, str, str, str]]:
    """Every (tag, arch, python, cuda) the tag matrix supports, for the tags with a series."""
    out = []
    for tag in (t.name for t in recipe.recipe_tags(matrix)):
        for arch in naming.ARCHES:
            for cuda in matrix.get_tag(tag).cudas(arch):
                for python in list(matrix.get_tag(tag).python):
                    out.append((tag, arch, python, cuda))
    return out


def test_renders_for_every_variant(matrix: Matrix) -> None:
    rendered = 0
    for tag, arch, python, cuda in variants(matrix):
        meta = recipe.render_for(matrix, tag, arch, python, cuda)
        assert meta["package"] == {"name": "pytorch", "version": matrix.get_tag(tag).version}
        assert meta["build"]["string"] == naming.conda_build_string(python, cuda, 0)
        assert "skip" not in meta["build"], f"{arch} cu{cuda} must not be skipped"
        assert meta["source"]["git_rev"] == tag
        run = recipe.run_depends(meta)
        host = meta["requirements"]["host"]
        build_reqs = meta["requirements"]["build"]
        assert f"gcc_{naming.CONDA_SUBDIRS[arch]}" in build_reqs
        assert f"cuda-version {cuda}" in host
        assert (("mkl" in run) == (arch == "x86_64")) and (
            ("openblas" in run) == (arch == "ppc64le")
        )
        major = int(cuda.split(".")[0])
        assert f"cuda-version >={cuda},<{major + 1}" in run
        assert ("cudatoolkit " + cuda + ".*" in run) == (major == 11)
        assert ("cuda-cudart" in run) == (major == 12)
        commands = " ".join(meta["test"]["commands"])
        assert "torch.cuda.set_enabled_lms" in commands
        assert "torch" in meta["test"]["imports"]
        assert meta["about"]["license"] == "BSD-3-Clause"
        assert recipe.listed_patches(meta) == [
            f"../../patches/{tag}/{p.name}" for p in recipe.series_patches(matrix, tag)
        ]
        rendered += 1
    expected = sum(
        len(t.python) * len(t.cudas(arch))
        for t in recipe.recipe_tags(matrix)
        for arch in naming.ARCHES
    )
    assert rendered == expected


def test_each_tag_builds_only_its_own_variants(repo: Path, matrix: Matrix) -> None:
    """conda-build builds the product of lms_tag, python and cuda_compiler_version: the
    recipe skips every variant outside the tag's own Pythons and CUDA versions."""
    supported = set(variants(matrix))
    for arch in naming.ARCHES:
        cfg = recipe.render_variant_config(
            repo / recipe.RECIPE_DIR, recipe.Variant(matrix.default_tag, arch, "3.11", "12.4")
        )
        for tag in cfg["lms_tag"]:
            for python in cfg["python"]:
                for cuda in cfg["cuda_compiler_version"]:
                    variant = recipe.Variant(tag, arch, python, cuda)
                    meta = recipe.render(repo / recipe.RECIPE_DIR, variant)
                    built = not meta["build"].get("skip", False)
                    assert built == ((tag, arch, python, cuda) in supported), variant


def test_ppc64le_cuda_12_6_is_skipped_by_the_recipe(repo: Path) -> None:
    variant = recipe.Variant("v2.6.0", "ppc64le", "3.11", "12.6")
    meta = recipe.render(repo / recipe.RECIPE_DIR, variant)
    assert meta["build"]["skip"] is True
    x86 = recipe.render(
        repo / recipe.RECIPE_DIR, recipe.Variant("v2.6.0", "x86_64", "3.11", "12.6")
    )
    assert "skip" not in x86["build"]


def test_render_rejects_unsupported_variant(matrix: Matrix) -> None:
    with pytest.raises(LmsToolError, match=r"last ppc64le toolkit is 12\.4"):
        recipe.render_for(matrix, "v2.6.0", "ppc64le", "3.11", "12.6")
    with pytest.raises(LmsToolError, match=r"Python 3\.7 is not supported"):
        recipe.render_for(matrix, "v2.6.0", "x86_64", "3.7", "12.6")


def test_selectors() -> None:
    ns = recipe.selector_namespace(recipe.Variant("v2.6.0", "ppc64le", "3.10", "12.4"))
    text = "a: 1  # [ppc64le]\nb: 2  # [x86_64]\nc: 3  # [py>=310 and linux]\nd: 4\n"
    assert recipe.apply_selectors(text, ns) == "a: 1\nc: 3\nd: 4\n"
    with pytest.raises(LmsToolError, match="cannot be evaluated"):
        recipe.apply_selectors("x: 1  # [windows_arm]\n", ns)


def test_variant_config_matches_the_tag_matrix(repo: Path, matrix: Matrix) -> None:
    tags = recipe.recipe_tags(matrix)
    for arch in naming.ARCHES:
        cfg = recipe.render_variant_config(
            repo / recipe.RECIPE_DIR, recipe.Variant(matrix.default_tag, arch, "3.11", "12.4")
        )
        assert cfg["lms_tag"] == [t.name for t in tags]
        pythons = {p for t in tags for p in t.python}
        assert cfg["python"] == sorted(pythons, key=naming.version_tuple)
        cudas = {c for t in tags for c in t.cudas(arch)}
        assert cfg["cuda_compiler_version"] == sorted(cudas, key=naming.version_tuple)
        assert ["cuda_compiler", "cuda_compiler_version"] in cfg["zip_keys"]
        compilers = dict(zip(cfg["cuda_compiler_version"], cfg["cuda_compiler"]))
        for cuda, name in compilers.items():
            assert name == ("nvcc" if cuda.startswith("11.") else "cuda-nvcc")
            meta = recipe.render(
                repo / recipe.RECIPE_DIR, recipe.Variant("v2.6.0", arch, "3.11", cuda)
            )
            assert f"{name}_{naming.CONDA_SUBDIRS[arch]}" in meta["requirements"]["build"]


def _build_sh_env(script: str, subdir: str, cuda: str) -> dict[str, str]:
    """The variables build.sh exports for one target, by running it up to the build."""
    head = script.split('"${PYTHON}" -m pip install')[0].replace("set -euxo", "set -euo")
    code = head + "\nenv\n"
    env = {
        "target_platform": subdir,
        "cuda_compiler_version": cuda,
        "PKG_VERSION": "2.6.0",
        "PKG_BUILDNUM": "0",
        "CPU_COUNT": "2",
        "PREFIX": "/p",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_build_sh_agrees_with_lmstool_build(repo: Path, matrix: Matrix) -> None:
    script = (repo / recipe.RECIPE_DIR / "build.sh").read_text()
    for arch in naming.ARCHES:
        for cuda in matrix.get_tag("v2.6.0").cudas(arch):
            cfg = plan.make_config(
                matrix, tag="v2.6.0", arch=arch, cuda=cuda, python="3.11", work=Path("work")
            )
            env = _build_sh_env(script, naming.CONDA_SUBDIRS[arch], cuda)
            for name, value in plan.build_environment(cfg).items():
                if name in ("MAX_JOBS", "PYTORCH_BUILD_NUMBER"):
                    continue
                assert env.get(name) == value, f"build.sh {arch} cu{cuda}: {name}"
    done = subprocess.run(
        ["bash", "-c", script.split('"${PYTHON}" -m pip install')[0]],
        env={"target_platform": "linux-ppc64le", "cuda_compiler_version": "12.6"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "no TORCH_CUDA_ARCH_LIST for linux-ppc64le CUDA 12.6" in done.stderr


def test_generated_parts_are_current(matrix: Matrix) -> None:
    """`lmstool recipe sync --check` in CI: the recipe agrees with config/ and patches/."""
    assert recipe.sync(matrix, check=True) == [], "run `make recipe-sync` and commit"
    from lmstool.cli import main

    assert main(["recipe", "sync", "--check"]) == 0


def test_sync_follows_the_matrix(repo: Path, tmp_path: Path) -> None:
    root = _tmp_repo(repo, tmp_path)
    tags = root / "config" / "tags.yaml"
    tags.write_text(tags.read_text().replace('"3.13"]', '"3.13", "3.14"]'))
    toolchain = root / "config" / "toolchain.yaml"
    toolchain.write_text(
        toolchain.read_text().replace(
            'ppc64le: "6.0;7.0;8.0"\n  "12.6"', 'ppc64le: "7.0;8.0"\n  "12.6"'
        )
    )
    (root / "patches" / "v2.6.0").mkdir(parents=True)
    (root / "patches" / "v2.6.0" / "0001-a.patch").write_text("From 0 Mon Sep 17 00:00:00 2001\n")
    matrix = load_matrix(root)
    changed = recipe.sync(matrix, check=True)
    names = sorted(p.name for p in changed)
    assert names == ["build.sh", "conda_build_config.yaml", "meta.yaml"]
    recipe.sync(matrix)
    cfg = recipe.render_variant_config(
        root / recipe.RECIPE_DIR, recipe.Variant("v2.6.0", "x86_64", "3.11", "12.4")
    )
    assert cfg["python"][-1] == "3.14"
    script = (root / recipe.RECIPE_DIR / "build.sh").read_text()
    assert 'linux-ppc64le/12.4) arch_list="7.0;8.0"' in script
    assert recipe.sync(matrix, check=True) == []


def _tmp_repo(repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(repo / "config", root / "config")
    shutil.copytree(repo / "recipes", root / "recipes")
    return root


def test_sync_lists_the_series_and_render_applies_it(repo: Path, tmp_path: Path) -> None:
    root = _tmp_repo(repo, tmp_path)
    series = root / "patches" / "v2.6.0"
    series.mkdir(parents=True)
    for name in ("0002-lms-allocator.patch", "0001-lms-engine.patch"):
        (series / name).write_text("From 0 Mon Sep 17 00:00:00 2001\n")
    matrix = load_matrix(root)
    assert recipe.sync(matrix, check=True) != []
    assert recipe.sync(matrix) != []
    assert recipe.sync(matrix, check=True) == []
    meta = recipe.render_for(matrix, "v2.6.0", "ppc64le", "3.11", "12.4")
    patches = recipe.listed_patches(meta)
    assert patches == [
        "../../patches/v2.6.0/0001-lms-engine.patch",
        "../../patches/v2.6.0/0002-lms-allocator.patch",
    ]
    recipe_dir = root / recipe.RECIPE_DIR
    assert all((recipe_dir / p).resolve().is_file() for p in patches)
    # Another tag's build does not get v2.6.0's patches.
    meta = recipe.render(recipe_dir, recipe.Variant("v1.13.1", "x86_64", "3.10", "11.7"))
    assert recipe.listed_patches(meta) == []
    assert meta["package"]["version"] == "1.13.1"


def test_sync_refuses_recipe_without_markers(repo: Path, tmp_path: Path) -> None:
    root = _tmp_repo(repo, tmp_path)
    meta = root / recipe.RECIPE_DIR / "meta.yaml"
    meta.write_text(meta.read_text().replace("# END lms-series", "# end"))
    with pytest.raises(LmsToolError, match="END lms-series"):
        recipe.sync(load_matrix(root))


def test_render_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from lmstool.cli import main

    code = main(["recipe", "render", "--arch", "ppc64le", "--python", "3.11", "--cuda", "12.4"])
    out, _ = capsys.readouterr()
    assert code == 0
    data = yaml.safe_load(out)
    assert data["build"]["string"] == "py311_cu124_lms_0"
    assert "# [" not in out
