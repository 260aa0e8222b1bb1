"""``lmstool patches`` and ``lmstool verify``: generating the committed series from engine/ and
integration/<tag>/, and checking that the committed series is current and applies."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lmstool.commands.series import add_source_arguments, spec_from_args
from lmstool.config import load_matrix
from lmstool.errors import LmsToolError
from lmstool.generate import Sources, generate, has_integration, series_path, verify_tag
from lmstool.source import SourceUnavailable

log = logging.getLogger(__name__)


def cmd_patches(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.repo)
    names = args.tags or list(matrix.tags)
    tags = [matrix.get_tag(n) for n in names]
    if args.to is not None and len(tags) != 1:
        raise LmsToolError("--to needs exactly one TAG; name the tag to generate")
    sources = Sources(matrix, spec_from_args(args), args.repo)
    for tag in tags:
        if not has_integration(args.repo, tag):
            print(f"{tag.name}: source only, no series ({series_path(args.repo, tag)} absent)")
            continue
        dest = args.to or tag.series_dir(args.repo)
        result = generate(sources, tag, dest, engine_dir=args.engine)
        print(f"{tag.name}: {result.summary(dest)}")
    return 0


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
            raise LmsToolError(
                f"{tag.name}: source unavailable: {exc} (or pass --skip-unavailable)"
            ) from None
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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "tags", nargs="*", metavar="TAG", help="tags from config/tags.yaml (default: all)"
    )
    p.add_argument(
        "--engine", type=Path, metavar="DIR", help="engine sources (default: engine/ of --repo)"
    )
    add_source_arguments(p)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "patches",
        help="generate patches/TAG/ from engine/ and integration/TAG/ (make patches)",
        description=(
            "Generate the committed series of each TAG: clone the pristine tag, commit the "
            "entries of integration/TAG/series in order (.engine entries copy engine/ into "
            "the tree, .patch entries are applied with git am) and write the commits to "
            "patches/TAG/ with stable format-patch options. Tags without "
            "integration/TAG/series are source only and are skipped."
        ),
    )
    _common(p)
    p.add_argument(
        "--to", type=Path, metavar="DIR", help="write here instead of patches/TAG (one tag)"
    )
    p.set_defaults(func=cmd_patches)

    p = sub.add_parser(
        "verify",
        help="check that each committed series applies and is up to date",
        description=(
            "For each TAG with a series: apply the committed patches/TAG/ to the pristine tag "
            "with git am, regenerate the series from engine/ and integration/TAG/ into a "
            "temporary folder and compare byte for byte. Exits 1 on any problem."
        ),
    )
    _common(p)
    p.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="skip (instead of failing) tags whose source cannot be found",
    )
    p.set_defaults(func=cmd_verify)
