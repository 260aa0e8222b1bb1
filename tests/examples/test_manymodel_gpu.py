"""examples/ManyModel.py on a GPU: a tiny real run with LMS that writes its statistics (GPU
machine only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from example_scripts import EXAMPLES, load

from lmsbench.harness import checkout_env
from tests.gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY


def _lms_or_skip() -> None:
    from lmsbench.lms_setup import LmsUnavailable, ensure_lms_api

    try:
        ensure_lms_api()
    except LmsUnavailable as exc:
        pytest.skip(str(exc))


def _env() -> dict[str, str]:
    """The session's environment with the drop-in extension's folder and the checkout on the
    Python path, as ManyModel.py's docstring asks."""
    env = checkout_env()
    extension = EXAMPLES.parent / "extension"
    env["PYTHONPATH"] = os.pathsep.join([str(extension), env["PYTHONPATH"]])
    return env


def test_manymodel_trains_with_lms_and_writes_stats(tmp_path: Path) -> None:
    pytest.importorskip("torchvision", reason="ManyModel.py trains torchvision models")
    _lms_or_skip()
    csv_path = tmp_path / "stats.csv"
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "ManyModel.py"),
            "resnet18",
            "--batch-size",
            "8",
            "--image-size",
            "64",
            "--iterations",
            "3",
            "--warmup",
            "1",
            "--lms",
            "--limit-mb",
            "64",
            "--stats-csv",
            str(csv_path),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = load("lmsstats").read_csv(csv_path)
    assert len(rows) == 3
    assert sum(r["pageout_bytes"] for r in rows) > 0
