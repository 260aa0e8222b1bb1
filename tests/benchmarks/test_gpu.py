"""The GPU paths of the benchmarks: a tiny real run of each (GPU machine only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lmsbench.harness import checkout_env
from tests.gpu_marks import GPU_ONLY

REPO = Path(__file__).resolve().parents[2]

pytestmark = GPU_ONLY


def _env() -> dict[str, str]:
    """The session's environment with the drop-in extension's folder and the checkout on the
    Python path, for the scripts run as programs."""
    env = checkout_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "extension"), env["PYTHONPATH"]])
    return env


def test_bandwidth_measurement_is_plausible() -> None:
    from benchmarks import compare

    bw = compare.measure_bandwidth(64 << 20, repeats=2)
    for value in (bw.d2h, bw.h2d, bw.bidirectional):
        assert 1e9 < value < 1e12


def test_compare_probe_fits_and_runs_out_of_memory() -> None:
    base = [
        sys.executable,
        str(REPO / "benchmarks/compare.py"),
        "--model",
        "gpt",
        "--gpt-layers",
        "2",
        "--gpt-dim",
        "256",
        "--gpt-heads",
        "4",
        "--gpt-seq",
        "128",
        "--gpt-vocab",
        "1024",
        "--probe-iterations",
        "1",
    ]
    fits = subprocess.run(
        [*base, "--probe-batch", "2", "--probe-cap-bytes", str(4 << 30)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert fits.returncode == 0, fits.stdout + fits.stderr
    oom = subprocess.run(
        [*base, "--probe-batch", "4096", "--probe-cap-bytes", str(256 << 20)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert oom.returncode == 3, oom.stdout + oom.stderr
