"""Build torch_lms: Large Model Support for an installed stock PyTorch wheel.

    pip install --no-build-isolation ./extension     # or
    cd extension && python setup.py build_ext --inplace

Needs the CUDA build of torch this extension will run with (headers come with
the wheel), the CUDA runtime headers and libcudart (CUDA_HOME, default
/usr/local/cuda) and a C++ compiler. No nvcc and no network access are needed.

The LMS engine (engine/c10/cuda), operator-boundary pinning
(engine/aten/src/ATen/cuda), the Python bindings (engine/torch/csrc/cuda) and
the torch.cuda LMS API (engine/torch/cuda/lms.py, and _lms_graph.py beside it)
are shared with the patched PyTorch build; they are copied from the repository
into this folder at build time so the installed package is self-contained.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - reported to the user
    raise SystemExit(
        "torch_lms builds against the installed PyTorch: install a CUDA build of torch "
        "first and build with `pip install --no-build-isolation ./extension`"
    ) from exc

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENGINE = Path(os.environ.get("TORCH_LMS_ENGINE_DIR", REPO / "engine"))
VENDOR = HERE / "_engine"  # git-ignored copy of the shared sources


def _engine_manifest():
    """lmstool/manifest.py (standard library only): the one list of engine files."""
    path = REPO / "lmstool" / "manifest.py"
    spec = importlib.util.spec_from_file_location("lms_manifest", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise SystemExit(f"torch_lms: {path} is missing; build from a project checkout")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_support():
    """torch_lms/_support.py (standard library only): supported torch releases, naming."""
    path = HERE / "torch_lms" / "_support.py"
    spec = importlib.util.spec_from_file_location("torch_lms_support", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"torch_lms: {path} is missing; build from a project checkout")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUPPORT = _load_support()
MANIFEST = _engine_manifest()
ENGINE_FILES = [p.as_posix() for p in MANIFEST.cxx_files(ENGINE)]
ENGINE_SOURCES = [p.as_posix() for p in MANIFEST.cxx_sources(ENGINE)]
# The torch.cuda LMS API (lms.py and the modules it imports from beside it, such as
# _lms_graph.py): torch/cuda/X.py in the PyTorch tree, torch_lms/X.py here.
API_MODULES = [
    p.as_posix() for p in MANIFEST.engine_files(ENGINE, "torch/cuda") if p.suffix == ".py"
]


def copy_if_changed(src: Path, dst: Path) -> None:
    if not src.is_file():
        raise SystemExit(
            f"torch_lms: shared source {src} is missing (TORCH_LMS_ENGINE_DIR={ENGINE})"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
        shutil.copyfile(src, dst)  # unchanged files keep their mtime: no rebuild


def vendor_shared_sources() -> None:
    for rel in ENGINE_FILES:
        copy_if_changed(ENGINE / rel, VENDOR / rel)
    for rel in API_MODULES:
        copy_if_changed(ENGINE / rel, HERE / "torch_lms" / Path(rel).name)


def cuda_home() -> Path:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "include" / "cuda_runtime_api.h").is_file():
            return Path(candidate)
    raise SystemExit(
        "torch_lms: cuda_runtime_api.h not found; set CUDA_HOME to the CUDA toolkit "
        "(the headers and libcudart of the CUDA version torch was built with)"
    )


def write_build_info(torch_version: str, cuda: str, version: str) -> None:
    """torch_lms/_build_info.py (git-ignored): the torch and CUDA this copy is built against,
    which the import-time check compares with the torch it is loaded into."""
    text = (
        "# Written by extension/setup.py: the torch this copy of torch_lms was built against.\n"
        f"TORCH_VERSION = {torch_version!r}\n"
        f"CUDA_VERSION = {cuda!r}\n"
        f"PACKAGE_VERSION = {version!r}\n"
    )
    path = HERE / "torch_lms" / "_build_info.py"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def main() -> None:
    if torch.version.cuda is None:
        raise SystemExit(
            f"torch_lms needs a CUDA build of PyTorch; torch {torch.__version__} is CPU-only"
        )
    if hasattr(torch._C, "_cuda_lms_setEnabled"):
        raise SystemExit(
            f"torch {torch.__version__} already has Large Model Support built in: "
            "use torch.cuda.set_enabled_lms() and do not install torch_lms"
        )
    if not SUPPORT.is_supported(torch.__version__):
        raise SystemExit(SUPPORT.unsupported_message(torch.__version__))
    vendor_shared_sources()
    version = SUPPORT.package_version(torch.__version__)
    write_build_info(torch.__version__, torch.version.cuda, version)
    cuda = cuda_home()
    lib_dirs = [str(d) for d in (cuda / "lib64", cuda / "lib") if d.is_dir()]
    sources = [
        *(f"_engine/{rel}" for rel in ENGINE_SOURCES),
        "csrc/StockAllocatorBackend.cpp",
        "csrc/Module.cpp",
    ]
    extension = CppExtension(
        name="torch_lms._C",
        sources=sources,
        include_dirs=[str(HERE / "_engine"), str(HERE / "_engine/aten/src"), str(cuda / "include")],
        library_dirs=lib_dirs,
        libraries=["c10_cuda", "cudart"],
        runtime_library_dirs=lib_dirs,
        extra_compile_args={"cxx": ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]},
    )
    setup(
        name=SUPPORT.DIST_NAME,
        version=f"{version}+{SUPPORT.cuda_label(torch.version.cuda)}",
        description="Large Model Support (tensor swapping to host memory) for stock PyTorch",
        packages=["torch_lms"],
        package_dir={"torch_lms": "torch_lms"},
        ext_modules=[extension],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        python_requires=">=3.9",
        zip_safe=False,
    )


if __name__ == "__main__":
    os.chdir(HERE)
    main()
