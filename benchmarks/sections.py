"""The generated sections of markdown files: the text between a begin and an end marker,
rewritten from committed results, or checked to be up to date."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


def replace_section(text: str, generated: str, begin: str, end: str) -> str:
    """``text`` with the part between the markers replaced by ``generated``."""
    try:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
    except ValueError:
        raise ValueError(f"the markers {begin!r} and {end!r} are missing") from None
    return f"{head}{begin}\n{generated}\n{end}{tail}"


def update(readme: Path, generated: Sequence[tuple[str, str, str]], check: bool, redo: str) -> int:
    """Writes the ``generated`` sections ((begin, end, text) each) into ``readme``, or with
    ``check`` says which are stale (``redo``: the command that rewrites them). 0: up to date
    or written, 1: stale, 2: markers missing."""
    text = readme.read_text()
    new = text
    try:
        for begin, end, section in generated:
            new = replace_section(new, section, begin, end)
    except ValueError as exc:
        print(f"summarize.py: {readme}: {exc}", file=sys.stderr)
        return 2
    if check:
        if new == text:
            return 0
        stale = [
            begin.split(":begin")[0].removeprefix("<!-- ")
            for begin, end, section in generated
            if replace_section(text, section, begin, end) != text
        ]
        print(f"summarize.py: {readme} is stale ({', '.join(stale)}): run {redo}", file=sys.stderr)
        return 1
    if new != text:
        readme.write_text(new)
        print(f"updated {readme}")
    return 0
