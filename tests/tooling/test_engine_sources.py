"""Rules the engine's C++ sources keep, checked on the text.

LargeModelSupport.h says why: in the drop-in extension, built against a stock wheel with
another toolchain, std::ostream's numeric insertion crashes the process, so the engine formats
numbers with std::to_string or snprintf and never streams them (no std::ostringstream, no
c10::str with numbers, no iostreams).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from toolfakes import REPO_ROOT

STREAMING = re.compile(
    r"#include\s*<(sstream|iostream|ostream)>|std::(o|i)?stringstream|std::c(out|err)\b|c10::str\("
)


def engine_sources() -> list[Path]:
    root = REPO_ROOT / "engine"
    return sorted(p for p in root.rglob("*") if p.suffix in {".h", ".cpp", ".cu"})


def test_there_are_engine_sources() -> None:
    assert len(engine_sources()) >= 6


@pytest.mark.parametrize("path", engine_sources(), ids=lambda p: p.name)
def test_engine_sources_never_stream(path: Path) -> None:
    hits = [
        f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if STREAMING.search(line) and not line.lstrip().startswith("//")
    ]
    assert not hits, "streams in the engine (use std::to_string or snprintf):\n" + "\n".join(hits)


def test_the_rule_catches_a_stream() -> None:
    assert STREAMING.search("#include <sstream>")
    assert STREAMING.search("  std::ostringstream out;")
    assert STREAMING.search('TORCH_WARN(c10::str("x", n));')
    assert not STREAMING.search('out += "size " + std::to_string(n);')
