"""Every patch carries the header CONTRIBUTING.md documents: Debian's DEP-3 fields.

DEP-3 (https://dep-team.pages.debian.net/deps/dep3/) accepts a git format-patch header (From:
as the author, Subject: and the body as the description) and spells the upstream status as
``Forwarded:`` (``not-needed``, ``no`` or the URL it was sent to) and, for fixes taken from
upstream, ``Origin:``. OpenEmbedded's ``Upstream-Status:`` is not used.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from toolfakes import REPO_ROOT

FORWARDED = re.compile(r"^Forwarded: (not-needed|no|https?://\S+)$")
ORIGIN = re.compile(r"^Origin: (upstream|backport|vendor|other), \S+$")


def patch_files() -> list[Path]:
    return sorted(REPO_ROOT.glob("patches/*/*.patch")) + sorted(
        REPO_ROOT.glob("integration/*/*.engine")
    )


def message(path: Path) -> list[str]:
    """The commit message lines of a mail-format patch (Subject: to the `---` line)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Subject: "))
    end = next((i for i, line in enumerate(lines) if line == "---"), len(lines))
    return lines[start:end]


def contributing_example() -> list[str]:
    text = (REPO_ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("## The header every patch carries", 1)[1]
    block = section.split("```", 2)[1]
    return block.strip("\n").splitlines()


def test_there_are_patches() -> None:
    assert len(patch_files()) >= 10


@pytest.mark.parametrize("path", patch_files(), ids=lambda p: p.name)
def test_patch_header_is_dep3(path: Path) -> None:
    lines = message(path)
    assert re.match(r"^Subject: \[PATCH\] [\w./-]+: \S", lines[0]), lines[0]
    forwarded = [line for line in lines if line.startswith("Forwarded:")]
    assert len(forwarded) == 1 and FORWARDED.match(forwarded[0]), forwarded
    assert not any(line.startswith("Upstream-Status:") for line in lines)
    for line in lines:
        if line.startswith("Origin:"):
            assert ORIGIN.match(line), line
    # The DEP-3 fields close the message.
    last = [line for line in lines if line.strip()][-1]
    assert re.match(r"^(Forwarded|Origin|Bug|Applied-Upstream|Last-Update):", last), last


def test_contributing_shows_the_header_the_patches_carry() -> None:
    example = contributing_example()
    assert example[0].startswith("From 0000000000000000000000000000000000000000 ")
    assert any(line.startswith("Subject: [PATCH] ") for line in example)
    fields = [line for line in example if re.match(r"^(Forwarded|Origin):", line)]
    assert fields == ["Forwarded: not-needed"]
    # The same field, spelled the same way, in every generated LMS patch.
    for path in sorted(REPO_ROOT.glob("patches/*/*.patch")):
        assert "Forwarded: not-needed" in message(path), path.name
    contributing = (REPO_ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert "Upstream-Status:` is not used" in contributing
    assert "Upstream-Status: " not in contributing
