"""How an error names what the user can type: a make variable or a command-line option.

The Makefile runs lmstool with ``LMSTOOL_FRONTEND=make``; messages then say ``SOURCES=DIR``
where a direct call says ``--sources DIR``. Every user-facing fix goes through
:func:`option`, so one message fits both ways of running the tool.
"""

from __future__ import annotations

import os

FRONTEND_ENV = "LMSTOOL_FRONTEND"
# The Makefile passes the source and work variables the user set (SOURCES=..., WORK=...), so
# that a make command a message suggests runs against the same source and work area.
MAKE_VARS_ENV = "LMSTOOL_MAKE_VARS"

# option name -> (command-line spelling, make spelling)
_SPELLINGS: dict[str, tuple[str, str]] = {
    "tag": ("TAG", "TAG="),
    "sources": ("--sources ", "SOURCES="),
    "remote": ("--remote ", "REMOTE="),
    "mirror": ("--mirror ", "MIRROR="),
    "work": ("--work ", "WORK="),
    "dest": ("--dest ", "WORK="),
    "tree": ("--tree ", "WORK="),
    "arch": ("--arch ", "ARCH="),
    "cuda": ("--cuda ", "CUDA="),
    "python": ("--python ", "PYTHON="),
    "python_exe": ("--python-exe ", "PYTHON_EXE="),
    "max_jobs": ("--max-jobs ", "MAX_JOBS="),
    "preflight": ("--preflight", "PREFLIGHT=1"),
    "channel": ("", "CHANNEL="),  # `lmstool channel index DIR`: a positional argument
}


def via_make() -> bool:
    return os.environ.get(FRONTEND_ENV, "") == "make"


def option(name: str, value: str = "") -> str:
    """``option("sources", "DIR")`` is ``SOURCES=DIR`` under make, ``--sources DIR`` otherwise.

    An empty ``value`` under make gives the blank assignment (``SOURCES=``), which is how a
    make user clears a variable that has a default.
    """
    cli, make = _SPELLINGS[name]
    if via_make():
        return f"{make}{value}"
    if name == "tag":
        return value or cli
    return f"{cli}{value}".rstrip()


def make_command(make: str) -> str:
    """``make`` with the source and work variables the user gave make appended
    (``make patch TAG=v2.6.0 SOURCES=../tarballs``), so that it runs as the user's did."""
    given = os.environ.get(MAKE_VARS_ENV, "").strip() if via_make() else ""
    return f"{make} {given}" if given else make


def command(cli: str, make: str) -> str:
    """The command to run next: ``make`` form under make (with the user's variables), the
    lmstool form otherwise."""
    return f"`{make_command(make)}`" if via_make() else f"`{cli}`"
