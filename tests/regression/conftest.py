"""End-to-end Large Model Support regression suite: real models trained under a memory cap.

Written against the ``torch.cuda`` LMS API only, so it runs unchanged on a PyTorch built with
the LMS patch series and on a stock wheel with the drop-in extension (``import torch_lms``,
done here when ``torch.cuda`` lacks the API). Without a CUDA device, or without LMS, every test
is skipped with the reason.

``LMS_RESULTS_DIR``: when set, the suite writes ``regression-results.json`` and
``regression-results.csv`` there (``lms_results.py``: device, versions, date, per-test
outcome, time, LMS stats, and on every row the engine commit, dirty flag, engine sources
hash, torch, CUDA, driver and device).

``LMS_REGRESSION_CUDNN=0`` disables cuDNN for the whole run (a triage switch: when a capped
run differs from its reference only with cuDNN on, cuDNN chose another algorithm under the
cap); the results record it.
"""

from __future__ import annotations

import os
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
                f"importable ({exc}); build it with `pip install --no-build-isolation ./extension`"
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("LMS_RESULTS_DIR", "").strip()
    if not out or not _RESULTS:
        return
    from tests.regression.lms_results import session_environment, write_results

    write_results(Path(out), session_environment(_BACKEND, CUDNN_ENABLED), _RESULTS)


@pytest.fixture(autouse=True)
def lms_clean(request: pytest.FixtureRequest) -> Any:
    """Every test starts and ends with LMS off, default settings and no memory cap."""
    if _SKIP_REASON is not None:
        yield
        return
    from tests.regression.lms_regression_harness import reset_lms

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
