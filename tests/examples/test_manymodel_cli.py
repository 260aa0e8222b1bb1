"""examples/ManyModel.py: argument parsing and validation, probe command lines, search range."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from example_scripts import EXAMPLES, load

from lmsbench.harness import checkout_env
from lmsbench.search import Outcome, Probe, SearchResult

ManyModel = load("ManyModel")
SCRIPT = EXAMPLES / "ManyModel.py"


def parse(*argv: str) -> argparse.Namespace:
    args = ManyModel.build_parser().parse_args(list(argv))
    ManyModel.check_args(args)
    return args


def test_defaults() -> None:
    args = parse()
    assert args.model == "resnet50" and not args.lms and args.search is None
    assert args.memory_cap_gb is None and args.prefetch == 0


def test_lms_knobs() -> None:
    args = parse(
        "vit_b_16",
        "--lms",
        "--limit-mb",
        "6000",
        "--size-mb",
        "0.5",
        "--prefetch",
        "2",
        "--speculative-mb",
        "256",
        "--memory-cap-gb",
        "7.5",
    )
    s = ManyModel.lms_settings(args, True)
    assert (s.enabled, s.limit_mb, s.size_mb, s.prefetch, s.speculative_mb) == (
        True,
        6000,
        0.5,
        2,
        256,
    )
    s.validate()
    assert not parse("--no-lms").lms


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "must be >= 1"),
        (["--memory-cap-gb", "-1"], "must be > 0"),
        (["--prefetch", "-2"], "must be >= 0"),
        (["--search", "depth"], "invalid choice"),
    ],
)
def test_rejected_by_the_parser(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        ManyModel.build_parser().parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--search", "batch"], "needs --memory-cap-gb"),
        (["--prefetch", "2"], "without --lms"),
        (["--limit-mb", "100", "--no-lms"], "without --lms"),
        (["--iterations", "2", "--warmup", "2"], "must be below --iterations"),
        (["--search", "batch", "--memory-cap-gb", "4", "--search-tolerance", "1"], "tolerance"),
        (["--search", "batch", "--memory-cap-gb", "4", "--stats-csv", "x.csv"], "not searches"),
    ],
)
def test_rejected_by_the_checks(argv: list[str], message: str) -> None:
    args = ManyModel.build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=message):
        ManyModel.check_args(args)


def test_probe_command_lines_round_trip() -> None:
    args = parse(
        "resnet152",
        "--search",
        "batch",
        "--memory-cap-gb",
        "8",
        "--image-size",
        "320",
        "--amp",
        "--limit-mb",
        "7000",
        "--prefetch",
        "1",
        "--search-iterations",
        "3",
    )
    with_lms = ManyModel.build_parser().parse_args(ManyModel.probe_argv(args, 24, True))
    assert with_lms.probe and with_lms.lms and with_lms.batch_size == 24
    assert with_lms.image_size == 320 and with_lms.amp and with_lms.memory_cap_gb == 8.0
    assert with_lms.limit_mb == 7000 and with_lms.prefetch == 1 and with_lms.iterations == 3
    assert with_lms.search is None
    ManyModel.check_args(with_lms)
    without = ManyModel.build_parser().parse_args(ManyModel.probe_argv(args, 24, False))
    assert not without.lms and without.limit_mb is None and without.prefetch == 0
    ManyModel.check_args(without)


def test_image_size_search_in_steps() -> None:
    args = parse(
        "vit_b_16",
        "--search",
        "image-size",
        "--memory-cap-gb",
        "8",
        "--image-size",
        "224",
        "--size-step",
        "16",
        "--search-max",
        "1024",
    )
    assert ManyModel.search_range(args) == (14, 64)
    probe = ManyModel.build_parser().parse_args(ManyModel.probe_argv(args, 20, False))
    assert probe.image_size == 320 and probe.batch_size == args.batch_size
    result = SearchResult(largest=20, probes=[Probe(20, Outcome.FITS)])
    assert ManyModel._scaled(result, 16) == "320"


def test_batch_search_range() -> None:
    args = parse(
        "--search", "batch", "--memory-cap-gb", "8", "--batch-size", "64", "--search-max", "32"
    )
    assert ManyModel.search_range(args) == (32, 32)


def test_ratio_text() -> None:
    assert ManyModel.ratio_text(SearchResult(40), SearchResult(4)) == "10.00x"
    assert ManyModel.ratio_text(SearchResult(40, upper_bound_hit=True), SearchResult(4)) == (
        "10.00x (lower bound)"
    )
    assert ManyModel.ratio_text(SearchResult(3), SearchResult(0)) == "without LMS nothing trains"
    assert ManyModel.ratio_text(SearchResult(0), SearchResult(0)) == "nothing trains either way"


def test_help_runs_as_a_program() -> None:
    """``python examples/ManyModel.py --help`` with the checkout on the Python path (as its
    docstring says: installed, or on ``PYTHONPATH``)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        env=checkout_env(),
        check=False,
    )
    assert done.returncode == 0
    for flag in (
        "--lms",
        "--no-lms",
        "--limit-mb",
        "--size-mb",
        "--prefetch",
        "--speculative-mb",
        "--memory-cap-gb",
        "--iterations",
        "--amp",
        "--search",
    ):
        assert flag in done.stdout
    assert "--probe " not in done.stdout  # internal flag hidden


def test_search_runs_probes_in_subprocesses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The search driver with a stand-in probe program: its largest values and the ratio."""
    fake = tmp_path / "fake_probe.py"
    fake.write_text(
        "import sys\n"
        "a = sys.argv[1:]\n"
        "b = int(a[a.index('--batch-size') + 1])\n"
        "limit = 48 if '--lms' in a else 5\n"
        "sys.exit(0 if b <= limit else 3)\n"
    )
    out = tmp_path / "search.json"
    args = parse(
        "resnet50",
        "--search",
        "batch",
        "--memory-cap-gb",
        "4",
        "--batch-size",
        "8",
        "--search-json",
        str(out),
    )
    assert ManyModel.run_search(args, script=str(fake)) == 0
    assert "with LMS: 48; ratio 9.60x" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["without_LMS"]["largest"] == 5 and data["with_LMS"]["largest"] == 48
    assert data["with_LMS"]["exact"]
