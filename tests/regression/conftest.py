"""End-to-end Large Model Support regression suite: real models trained under a memory cap.

Written against the ``torch.cuda`` LMS API only, so it runs unchanged on a PyTorch built with
the LMS patch series and on a stock wheel with the drop-in extension (``import torch_lms``,
done here when ``torch.cuda`` lacks the API). Without a CUDA device, or without LMS, every test
is skipped with the reason.

``LMS_RESULTS_DIR``: when set, the suite writes ``regression-results.json`` and
``regression-results.csv`` there (device, versions, date, per-test outcome, time, LMS stats).

``LMS_REGRESSION_CUDNN=0`` disables cuDNN for the whole run (a triage switch: when a capped
run differs from its reference only with cuDNN on, cuDNN chose another algorithm under the
cap); the results record it.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import pytest

# Deterministic cuBLAS needs this before the first cuBLAS handle is created.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

_SKIP_REASON: str | None = None
_BACKEND = "none"
try:
    import torch
    import torch.cuda
except ImportError:
    torch = None  # type: ignore[assignment]
    _SKIP_REASON = "PyTorch is not installed"

if torch is not None:
    if not torch.cuda.is_available():
        _SKIP_REASON = "no CUDA device: the regression suite trains models on a GPU"
    elif hasattr(torch.cuda, "set_enabled_lms"):
        _BACKEND = "patched"
    else:
        try:
            import torch_lms  # noqa: F401  (installs the torch.cuda LMS API)

            _BACKEND = "extension"
        except ImportError as exc:
            _SKIP_REASON = (
                "this PyTorch has no Large Model Support and the torch_lms extension is not "
                f"importable ({exc}); build it with `pip install --no-build-isolation -e extension`"
            )


CUDNN_ENABLED = os.environ.get("LMS_REGRESSION_CUDNN", "1") != "0"
if torch is not None and not CUDNN_ENABLED:
    torch.backends.cudnn.enabled = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if _SKIP_REASON is not None:
                item.add_marker(pytest.mark.skip(reason=_SKIP_REASON))


_RESULTS: list[dict[str, Any]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    here = Path(__file__).resolve().parent
    if here not in Path(str(item.fspath)).resolve().parents:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry: dict[str, Any] = {
            "test": item.nodeid,
            "outcome": report.outcome,
            "seconds": round(report.duration, 3),
        }
        for key, value in item.user_properties:
            entry[key] = value
        if report.outcome == "failed":
            entry["error"] = str(report.longrepr)[-2000:]
        _RESULTS.append(entry)


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "lms_backend": _BACKEND,
    }
    if torch is not None:
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
        env["cudnn_enabled"] = CUDNN_ENABLED
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["device"] = props.name
            env["device_memory_bytes"] = props.total_memory
        try:
            import torchvision

            env["torchvision"] = torchvision.__version__
        except ImportError:
            env["torchvision"] = None
    return env


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("LMS_RESULTS_DIR", "").strip()
    if not out or not _RESULTS:
        return
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    env = _environment()
    (path / "regression-results.json").write_text(
        json.dumps({"environment": env, "tests": _RESULTS}, indent=2, default=str) + "\n"
    )
    columns = ["test", "outcome", "seconds"]
    extra = sorted({k for r in _RESULTS for k in r} - set(columns) - {"error"})
    with (path / "regression-results.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*columns, *extra, *env.keys()])
        for r in _RESULTS:
            row = [r.get(c) for c in columns]
            row += [json.dumps(r[k], default=str) if k in r else "" for k in extra]
            writer.writerow(row + list(env.values()))


@pytest.fixture(autouse=True)
def lms_clean(request: pytest.FixtureRequest) -> Any:
    """Every test starts and ends with LMS off, default settings and no memory cap."""
    if _SKIP_REASON is not None:
        yield
        return
    from lms_regression_harness import reset_lms

    reset_lms()
    start = time.perf_counter()
    yield
    request.node.user_properties.append(("wall_seconds", round(time.perf_counter() - start, 3)))
    reset_lms()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Any:
    """record(key, value): adds a value to this test's entry in the results files."""

    def add(key: str, value: Any) -> None:
        request.node.user_properties.append((key, value))

    return add
