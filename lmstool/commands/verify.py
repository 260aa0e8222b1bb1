"""``lmstool verify``: the committed series applies to the pristine tag and is current."""

from __future__ import annotations

import argparse

from lmstool.commands.common import spec_from_args
from lmstool.commands.patches import add_tag_arguments
from lmstool.errors import LmsToolError
from lmstool.generate import Sources, verify_tag
from lmstool.hints import via_make
from lmstool.matrix import load_matrix
from lmstool.source import SourceUnavailable


def cmd_verify(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    names = args.tags or list(matrix.tags)
    tags = [matrix.get_tag(n) for n in names]
    sources = Sources(matrix, spec_from_args(args), args.repo)
    failed: list[str] = []
    for tag in tags:
        try:
            report = verify_tag(sources, tag, engine_dir=args.engine)
        except SourceUnavailable as exc:
            if args.skip_unavailable:
                print(f"{tag.name}: SKIPPED, source unavailable: {exc}")
                continue
            # The source's own message already says how to give another source; add only
            # what verify alone can do.
            skip = "" if via_make() else " (or pass --skip-unavailable to go on without it)"
            raise LmsToolError(f"{tag.name}: source unavailable: {exc}{skip}") from None
        for note in report.notes:
            print(f"{tag.name}: {note}")
        for problem in report.problems:
            print(f"{tag.name}: FAIL: {problem}")
        if not report.ok:
            failed.append(tag.name)
    if failed:
        print(f"verify failed for {', '.join(failed)}")
        return 1
    print(f"verify ok: {', '.join(t.name for t in tags)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "verify",
        help="check that each committed series applies and is up to date",
        description=(
            "For each TAG with a series: apply the committed patches/TAG/ to the pristine tag "
            "with git am, regenerate the series from engine/ and integration/TAG/ into a "
            "temporary folder and compare byte for byte. Exits 1 on any problem."
        ),
    )
    add_tag_arguments(p)
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="skip (instead of failing) tags whose source cannot be found",
    )
    p.set_defaults(func=cmd_verify)
