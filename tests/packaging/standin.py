"""Tiny stand-in wheels named like PyTorch's, built in tests (no PyTorch needed)."""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

TORCH_INIT = '''"""Stand-in for torch with the LMS API surface."""
__version__ = "{version}"
from torch import cuda  # noqa: E402,F401
'''
TORCH_CUDA = """_enabled = False
def set_enabled_lms(enable):
    global _enabled
    _enabled = bool(enable)
def get_enabled_lms():
    return _enabled
"""


def torch_version_py(version: str) -> str:
    """torch/version.py as PyTorch writes it; the CUDA version from a local version's
    ``cuXYZ`` (2.6.0+lms.cu126: 12.6), none (a CPU build) without one."""
    match = re.search(r"cu(\d+)(\d)$", version)
    cuda = f"'{match[1]}.{match[2]}'" if match else "None"
    return (
        "from typing import Optional\n"
        f"__version__ = '{version}'\n"
        f"cuda: Optional[str] = {cuda}\n"
        "git_version = 'stand-in'\n"
    )


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def make_wheel(
    folder: Path,
    *,
    name: str = "torch",
    version: str = "2.6.0+lms.cu126",
    python: str = "3.11",
    plat: str = "manylinux_2_28_x86_64",
    files: Mapping[str, str] | None = None,
    console_scripts: Mapping[str, str] | None = None,
) -> Path:
    """Write a valid wheel (METADATA, WHEEL, RECORD) and return its path."""
    cp = "cp" + python.replace(".", "")
    if files is None:
        files = {
            f"{name}/__init__.py": TORCH_INIT.format(version=version),
            f"{name}/cuda/__init__.py": TORCH_CUDA,
            f"{name}/cuda/lms.py": TORCH_CUDA,
            f"{name}/version.py": torch_version_py(version),
            f"{name}/lib/libc10_cuda.so": "not really a library\n",
        }
    dist = f"{name}-{version}.dist-info"
    members: dict[str, bytes] = {path: text.encode() for path, text in files.items()}
    members[f"{dist}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Dist: filelock\n"
    ).encode()
    members[f"{dist}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: lmstool-tests\nRoot-Is-Purelib: false\n"
        f"Tag: {cp}-{cp}-{plat}\n"
    ).encode()
    if console_scripts:
        lines = "".join(f"{k} = {v}\n" for k, v in console_scripts.items())
        members[f"{dist}/entry_points.txt"] = f"[console_scripts]\n{lines}".encode()
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in members.items())
    record += f"{dist}/RECORD,,\n"
    members[f"{dist}/RECORD"] = record.encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-{cp}-{cp}-{plat}.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path, data in members.items():
            info = zipfile.ZipInfo(path, date_time=(2025, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    return wheel


def make_conda_package(
    folder: Path, *, name: str, version: str, subdir: str, files: Mapping[str, str]
) -> Path:
    """A minimal conda package (e.g. a stand-in `python`) made with conda-package-handling."""
    import json
    import tempfile

    from conda_package_handling import api

    arch = {"linux-64": "x86_64", "linux-ppc64le": "ppc64le"}[subdir]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp)
        paths = []
        for rel, text in files.items():
            target = prefix / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            data = text.encode()
            paths.append(
                {
                    "_path": rel,
                    "path_type": "hardlink",
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size_in_bytes": len(data),
                }
            )
        (prefix / "info").mkdir()
        index = {
            "name": name,
            "version": version,
            "build": "0",
            "build_number": 0,
            "depends": [],
            "subdir": subdir,
            "arch": arch,
            "platform": "linux",
        }
        (prefix / "info" / "index.json").write_text(json.dumps(index))
        (prefix / "info" / "paths.json").write_text(
            json.dumps({"paths": paths, "paths_version": 1})
        )
        (prefix / "info" / "files").write_text("".join(f"{rel}\n" for rel in files))
        members = sorted(p.relative_to(prefix).as_posix() for p in prefix.rglob("*") if p.is_file())
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{name}-{version}-0"
        api.create(str(prefix), members, f"{stem}.conda", out_folder=str(folder))
    return folder / f"{stem}.conda"
