"""The committed results grow by summaries, not by megabytes: a raw file over 256 KiB is kept
compressed (xz, or a tarball of a run's folders), and the tools read it as it is."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 256 * 1024
COMPRESSED = (".xz", ".gz", ".tgz", ".png")


def test_no_raw_result_file_is_over_the_limit() -> None:
    files = subprocess.run(
        ["git", "ls-files", "benchmarks/results"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert files, "no committed results found"
    too_big = [
        f"{name} ({(REPO / name).stat().st_size // 1024} KiB)"
        for name in files
        if not name.endswith(COMPRESSED)
        and (REPO / name).is_file()
        and (REPO / name).stat().st_size > LIMIT_BYTES
    ]
    assert not too_big, (
        "raw result files over 256 KiB: compress each with `xz -9 FILE` (the stress tools and "
        "summarize.py read results.jsonl.xz) or summarize the run: " + ", ".join(too_big)
    )
