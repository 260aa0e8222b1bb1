"""The engine's tables of settings and statistics, and the Python lists made from them.

``engine/c10/cuda/LargeModelSupportSettingTable.h`` has a row per setting and
``LargeModelSupportStatTable.h`` a row per statistic. The C++ that needs them (the engine's
declarations and option parser, the bindings, the stats struct and dict) expands the rows
with X-macros; the Python that needs them as lists (``torch/cuda/lms.py``'s ``__all__``,
docstring and stat keys, the drop-in extension's ``API_NAMES``, the GPU test's stat keys)
holds them between ``lms-tables:NAME:begin`` and ``lms-tables:NAME:end`` markers, which
:func:`regenerate` rewrites from the rows (``lmstool tables``; ``--check`` fails where a list
is stale, and the test suite runs it).

Standard library only, like :mod:`lmstool.manifest`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SETTING_TABLE = Path("engine/c10/cuda/LargeModelSupportSettingTable.h")
STAT_TABLE = Path("engine/c10/cuda/LargeModelSupportStatTable.h")

# How a PYTORCH_CUDA_ALLOC_CONF value of each kind is written, for the docs.
KIND_VALUES = {
    "Bool": "True or False",
    "Mebibytes": "MiB",
    "Count": "a whole number",
    "Seconds": "seconds",
    "Path": "a directory",
}


@dataclass(frozen=True)
class Setting:
    """A row of the settings table."""

    stem: str  # torch.cuda.set_<stem>_lms / get_<stem>_lms
    camel: str  # _cuda_lms_set<Camel> / _cuda_lms_get<Camel>
    key: str  # PYTORCH_CUDA_ALLOC_CONF key
    kind: str  # Bool, Mebibytes, Count, Seconds or Path
    type: str  # the engine's C++ type of the value
    setter: str
    getter: str
    what: str
    per_device: bool

    @property
    def functions(self) -> tuple[str, str]:
        """The Python API's setter and getter."""
        return f"set_{self.stem}_lms", f"get_{self.stem}_lms"

    @property
    def bindings(self) -> tuple[str, str]:
        """The bindings behind them."""
        return f"_cuda_lms_set{self.camel}", f"_cuda_lms_get{self.camel}"


@dataclass(frozen=True)
class Stat:
    """A row of the statistics table: a counter (its C++ type) or a gauge."""

    name: str
    type: str  # int64_t, double, size_t, or LmsStat for a gauge

    @property
    def gauge(self) -> bool:
        return self.type == "LmsStat"


_ROW = re.compile(r"^(C10_LMS_\w+)\((.*)\)$")
# A line's code: quoted strings whole, up to a // comment.
_CODE = re.compile(r'^(?:"[^"]*"|[^"/]|/(?!/))*')


def _rows(path: Path) -> list[tuple[str, list[str]]]:
    """The macro rows of a table file: the macro and its arguments (quotes kept)."""
    rows: list[tuple[str, list[str]]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        code = _CODE.match(line)
        match = _ROW.match(code.group(0).strip() if code else "")
        if match is None:
            continue
        args = [arg.strip() for arg in re.findall(r'"[^"]*"|[^,]+', match.group(2))]
        rows.append((match.group(1), args))
    return rows


def read_settings(repo: Path) -> list[Setting]:
    """The rows of the settings table, in its order."""
    settings = []
    for macro, args in _rows(repo / SETTING_TABLE):
        if macro not in ("C10_LMS_SETTING", "C10_LMS_DEVICE_SETTING"):
            raise ValueError(f"{SETTING_TABLE}: unknown row {macro}({', '.join(args)})")
        device = macro == "C10_LMS_DEVICE_SETTING"
        if len(args) != (9 if device else 8) or args[3] not in KIND_VALUES:
            raise ValueError(f"{SETTING_TABLE}: malformed row {macro}({', '.join(args)})")
        stem, camel, key, kind, type_, setter, getter, what = args[:8]
        settings.append(
            Setting(stem, camel, key, kind, type_, setter, getter, what.strip('"'), device)
        )
    return settings


def read_stats(repo: Path) -> list[Stat]:
    """The rows of the statistics table, in its order (the order of ``lms_stats()``)."""
    stats = []
    for macro, args in _rows(repo / STAT_TABLE):
        if macro == "C10_LMS_COUNTER" and len(args) == 2:
            stats.append(Stat(args[1], args[0]))
        elif macro == "C10_LMS_GAUGE" and len(args) == 1:
            stats.append(Stat(args[0], "LmsStat"))
        else:
            raise ValueError(f"{STAT_TABLE}: malformed row {macro}({', '.join(args)})")
    return stats


def _strings(names: list[str]) -> list[str]:
    return [f'"{name}",' for name in names]


def _conf_keys(settings: list[Setting]) -> list[str]:
    """The PYTORCH_CUDA_ALLOC_CONF keys as a reST list for a docstring."""
    lines = []
    for s in settings:
        scope = ", every device" if s.per_device else ""
        lines.append(f"- ``{s.key}`` ({KIND_VALUES[s.kind]}{scope}): :func:`{s.functions[0]}`")
    return lines


def blocks(repo: Path) -> dict[str, list[str]]:
    """The generated lines of each block, by block name (unindented)."""
    settings = read_settings(repo)
    stats = read_stats(repo)
    counters = [s.name for s in stats if not s.gauge]
    return {
        "setting-functions": _strings([f for s in settings for f in s.functions]),
        # For a sorted __all__: the getters, then (after the other names) the setters.
        "setting-getters": _strings(sorted(s.functions[1] for s in settings)),
        "setting-setters": _strings(sorted(s.functions[0] for s in settings)),
        "conf-keys": _conf_keys(settings),
        "counter-keys": _strings(counters),
        "float-counter-keys": _strings([s.name for s in stats if s.type == "double"]),
        "gauge-keys": _strings([s.name for s in stats if s.gauge]),
    }


# The files that hold generated blocks, and which.
TARGETS: dict[Path, tuple[str, ...]] = {
    Path("engine/torch/cuda/lms.py"): (
        "conf-keys",
        "setting-getters",
        "setting-setters",
        "counter-keys",
        "gauge-keys",
    ),
    Path("extension/torch_lms/_integration.py"): ("setting-functions",),
    Path("engine/test/test_cuda_lms.py"): ("counter-keys", "float-counter-keys", "gauge-keys"),
}


def _marker(name: str, end: bool) -> re.Pattern[str]:
    """A marker line: a Python comment, or a reST comment in a docstring."""
    which = "end" if end else "begin"
    return re.compile(rf"^(\s*)(?:#|\.\.) lms-tables:{re.escape(name)}:{which}\b")


def rewrite(text: str, path: Path, names: tuple[str, ...], generated: dict[str, list[str]]) -> str:
    """``text`` with the lines between each block's markers replaced by its generated lines,
    indented as its begin marker is (a blank line stays around a block in a docstring)."""
    lines = text.split("\n")
    for name in names:
        begin = [i for i, line in enumerate(lines) if _marker(name, end=False).match(line)]
        end = [i for i, line in enumerate(lines) if _marker(name, end=True).match(line)]
        if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
            raise ValueError(f"{path}: expected one lms-tables:{name}:begin and :end marker")
        match = _marker(name, end=False).match(lines[begin[0]])
        assert match is not None
        indent = match.group(1)
        body = [f"{indent}{line}" for line in generated[name]]
        if lines[begin[0]].lstrip().startswith(".."):  # reST: the comments stand apart
            body = ["", *body, ""]
        lines[begin[0] + 1 : end[0]] = body
    return "\n".join(lines)


def regenerate(repo: Path, check: bool = False) -> list[Path]:
    """Rewrites the generated blocks of every target from the tables; returns the targets
    that were stale (with ``check``, writes nothing)."""
    generated = blocks(repo)
    stale = []
    for rel, names in TARGETS.items():
        path = repo / rel
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, rel, names, generated)
        if new != text:
            stale.append(rel)
            if not check:
                path.write_text(new, encoding="utf-8")
    return stale
