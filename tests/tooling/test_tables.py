"""lmstool tables: the Python lists made from the engine's tables of settings and statistics
are up to date, and the tables read as the C++ expands them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmstool import tables
from lmstool.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_generated_lists_are_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    """Every block between lms-tables markers matches the tables (`python -m lmstool tables`
    rewrites them)."""
    code = main(["--repo", str(REPO), "tables", "--check"])
    assert code == 0, capsys.readouterr().err


def test_the_tables_read_whole() -> None:
    settings = tables.read_settings(REPO)
    keys = [s.key for s in settings]
    assert keys[:2] == ["lms", "lms_limit_mb"] and len(keys) == len(set(keys))
    assert [s.stem for s in settings if s.per_device] == ["limit"]
    packing = next(s for s in settings if s.key == "lms_pack")
    assert packing.functions == ("set_packing_lms", "get_packing_lms")
    assert packing.bindings == ("_cuda_lms_setPacking", "_cuda_lms_getPacking")
    assert {s.kind for s in settings} == set(tables.KIND_VALUES)
    stats = tables.read_stats(REPO)
    names = [s.name for s in stats]
    assert len(names) == len(set(names))
    # A row with a comment that holds parentheses reads as its macro's arguments alone.
    explicit = next(s for s in stats if s.name == "reclaim_explicit")
    assert explicit.type == "int64_t"
    assert [s.name for s in stats if s.type == "double"] == [
        "stall_ms",
        "copy_out_ms",
        "copy_in_ms",
        "recompute_ms",
        "host_pin_ms",
        "host_wait_ms",
        "host_copy_wait_ms",
        "device_wait_ms",
        "spill_out_ms",
        "spill_in_ms",
    ]


def _copy_repo(tmp_path: Path) -> Path:
    for rel in (tables.SETTING_TABLE, tables.STAT_TABLE, *tables.TARGETS):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())
    return tmp_path


def test_a_new_row_makes_the_lists_stale(tmp_path: Path) -> None:
    repo = _copy_repo(tmp_path)
    table = repo / tables.STAT_TABLE
    table.write_text(
        table.read_text().replace(
            "C10_LMS_GAUGE(private_pool_bytes)",
            "C10_LMS_GAUGE(private_pool_bytes)\nC10_LMS_COUNTER(double, spill_ms)",
        )
    )
    assert tables.regenerate(repo, check=True) == [
        Path("engine/torch/cuda/lms.py"),
        Path("engine/test/test_cuda_lms.py"),
    ]
    assert tables.regenerate(repo) != []
    assert tables.regenerate(repo, check=True) == []
    test = (repo / "engine/test/test_cuda_lms.py").read_text()
    floats = test[test.index("FLOAT_COUNTERS = (") : test.index("GAUGES = (")]
    assert '"spill_ms",' in floats


def test_a_missing_marker_is_an_error(tmp_path: Path) -> None:
    repo = _copy_repo(tmp_path)
    api = repo / "extension/torch_lms/_integration.py"
    api.write_text(api.read_text().replace("# lms-tables:setting-functions:end", ""))
    with pytest.raises(ValueError, match="setting-functions"):
        tables.regenerate(repo, check=True)


def test_every_setting_is_in_the_users_settings_table() -> None:
    """docs/using-lms.md's settings table (written by hand: defaults and what each does) has a
    line for every setting, with its setter and its key."""
    guide = (REPO / "docs/using-lms.md").read_text()
    section = guide[
        guide.index("## Settings") : guide.index("\n## ", guide.index("## Settings") + 1)
    ]
    rows = [line for line in section.splitlines() if line.startswith("| `set_")]
    for setting in tables.read_settings(REPO):
        setter = setting.functions[0]
        row = [line for line in rows if line.startswith(f"| `{setter}(")]
        assert len(row) == 1, setter
        assert f"`{setting.key}" in row[0], (setter, setting.key)
