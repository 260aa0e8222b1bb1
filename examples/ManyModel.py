#!/usr/bin/env python3
"""Train any torchvision classification model on synthetic images, with or without Large
Model Support, and find the largest batch or image size that trains under a memory cap.

Train (prints each iteration's time and LMS activity)::

    ManyModel.py resnet152 --image-size 512 --batch-size 16 --memory-cap-gb 8 --lms
    ManyModel.py vit_l_16 --batch-size 64 --lms --limit-mb 6000 --prefetch 2 --amp \\
        --stats-csv vit.csv --stats-png vit.png

Search (every probe a fresh subprocess; reports both and their ratio)::

    ManyModel.py resnet50 --memory-cap-gb 8 --search batch
    ManyModel.py resnet50 --memory-cap-gb 8 --batch-size 4 --search image-size --size-step 32

On a PyTorch built with the LMS patch series the API is ``torch.cuda.set_enabled_lms`` and
friends; on a stock CUDA wheel the drop-in extension ``torch_lms`` is imported when
``--lms`` is given (from the Python path or this checkout's ``extension/`` folder).

Needs torch and torchvision, and this checkout's ``lmsbench`` package: installed (``make
venv``, or ``pip install -e .`` at the repository root) or on the Python path
(``PYTHONPATH=<repository root> python examples/ManyModel.py ...``). ``lmsstats.py`` beside it
writes the statistics (``--stats-csv``, ``--stats-png``; the PNG needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmsbench.lms_setup import (
    EXIT_OOM,
    GiB,
    LmsSettings,
    LmsUnavailable,
    add_lms_tuning_options,
    nonneg_int,
    positive_float,
    positive_int,
)
from lmsbench.search import SearchResult, find_largest, python_command, subprocess_probe

SEARCH_DEFAULT_MAX = {"batch": 4096, "image-size": 8192}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ManyModel.py",
        description="Train a torchvision model on synthetic images with or without Large "
        "Model Support, or search the largest batch / image size that trains under a cap.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        default="resnet50",
        help="torchvision classification model name (see --list-models)",
    )
    parser.add_argument(
        "--list-models", action="store_true", help="print the available model names and exit"
    )
    data = parser.add_argument_group("training")
    data.add_argument("--batch-size", type=positive_int, default=32, help="images per batch")
    data.add_argument("--image-size", type=positive_int, default=224, help="image side, pixels")
    data.add_argument("--num-classes", type=positive_int, default=1000, help="classes")
    data.add_argument("--iterations", type=positive_int, default=10, help="training iterations")
    data.add_argument(
        "--warmup", type=nonneg_int, default=2, help="first iterations left out of the mean time"
    )
    data.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="optimizer")
    data.add_argument("--amp", action="store_true", help="bf16 autocast")
    data.add_argument("--channels-last", action="store_true", help="channels-last images")
    lms = parser.add_argument_group("Large Model Support")
    lms.add_argument(
        "--lms", action=argparse.BooleanOptionalAction, default=False, help="enable LMS"
    )
    lms.add_argument(
        "--limit-mb",
        type=positive_int,
        default=None,
        help="LMS limit in MiB (default: none, the process's share of the device applies: "
        "the device less other processes' memory, less 5%% headroom; never above the "
        "--memory-cap-gb cap)",
    )
    add_lms_tuning_options(lms)
    lms.add_argument(
        "--oom-retries",
        type=nonneg_int,
        default=0,
        help="retry a step that ran out of memory this many times in all (with "
        "the drop-in extension an operator cannot retry by itself)",
    )
    parser.add_argument(
        "--memory-cap-gb",
        type=positive_float,
        default=None,
        help="cap the caching allocator at this many GiB "
        "(torch.cuda.set_per_process_memory_fraction)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--stats-csv",
        type=Path,
        default=None,
        help="per-iteration statistics CSV (see lmsstats.py)",
    )
    out.add_argument(
        "--stats-png", type=Path, default=None, help="per-iteration timeline PNG (needs matplotlib)"
    )
    out.add_argument("--quiet", action="store_true", help="no per-iteration lines")
    search = parser.add_argument_group("search")
    search.add_argument(
        "--search",
        choices=("batch", "image-size"),
        default=None,
        help="find the largest batch or image size that trains, with and "
        "without LMS, under --memory-cap-gb",
    )
    search.add_argument(
        "--search-start",
        type=positive_int,
        default=None,
        help="first value tried (default: --batch-size or --image-size)",
    )
    search.add_argument(
        "--search-max",
        type=positive_int,
        default=None,
        help="largest value tried (default: 4096 images or 8192 pixels)",
    )
    search.add_argument(
        "--size-step",
        type=positive_int,
        default=1,
        help="image sizes searched are multiples of this (e.g. 32, or the patch size of a ViT)",
    )
    search.add_argument(
        "--search-iterations", type=positive_int, default=2, help="iterations each probe trains"
    )
    search.add_argument(
        "--search-tolerance",
        type=float,
        default=0.0,
        help="stop when the bracket is within this share of the value (0: exact)",
    )
    search.add_argument(
        "--probe-timeout",
        type=positive_float,
        default=300.0,
        help="seconds; a slower probe counts as not trainable",
    )
    search.add_argument("--search-json", type=Path, default=None, help="write the result here")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Cross-argument checks; raises ValueError."""
    if args.search is not None:
        if args.memory_cap_gb is None:
            raise ValueError("--search needs --memory-cap-gb: the cap both searches run under")
        if not 0 <= args.search_tolerance < 1:
            raise ValueError(f"--search-tolerance must be in [0, 1), got {args.search_tolerance}")
        if args.search == "image-size" and args.size_step > (args.search_max or 8192):
            raise ValueError("--size-step is larger than --search-max")
        if args.stats_csv or args.stats_png:
            raise ValueError("--stats-csv/--stats-png record training runs, not searches")
    if args.warmup >= args.iterations and not args.probe and args.search is None:
        raise ValueError(f"--warmup ({args.warmup}) must be below --iterations ({args.iterations})")
    if not args.lms:
        tuned = [
            name
            for name, value in (
                ("--limit-mb", args.limit_mb),
                ("--size-mb", args.size_mb),
            )
            if value is not None
        ]
        tuned += [
            name
            for name, value in (
                ("--prefetch", args.prefetch),
                ("--speculative-mb", args.speculative_mb),
            )
            if value
        ]
        if tuned and args.search is None:
            raise ValueError(f"{', '.join(tuned)} set without --lms")


def lms_settings(args: argparse.Namespace, enabled: bool) -> LmsSettings:
    return LmsSettings(
        enabled=enabled,
        limit_mb=args.limit_mb,
        size_mb=args.size_mb,
        prefetch=args.prefetch,
        speculative_mb=args.speculative_mb,
    )


def probe_argv(args: argparse.Namespace, value: int, lms: bool) -> list[str]:
    """Arguments of the subprocess that tries one value of the search."""
    batch = value if args.search == "batch" else args.batch_size
    size = value * args.size_step if args.search == "image-size" else args.image_size
    argv = [
        args.model,
        "--probe",
        "--quiet",
        "--batch-size",
        str(batch),
        "--image-size",
        str(size),
        "--num-classes",
        str(args.num_classes),
        "--iterations",
        str(args.search_iterations),
        "--warmup",
        "0",
        "--optimizer",
        args.optimizer,
        "--memory-cap-gb",
        repr(args.memory_cap_gb),
        "--oom-retries",
        str(args.oom_retries),
        "--lms" if lms else "--no-lms",
    ]
    if args.amp:
        argv.append("--amp")
    if args.channels_last:
        argv.append("--channels-last")
    if lms:
        argv += ["--prefetch", str(args.prefetch), "--speculative-mb", str(args.speculative_mb)]
        if args.limit_mb is not None:
            argv += ["--limit-mb", str(args.limit_mb)]
        if args.size_mb is not None:
            argv += ["--size-mb", repr(args.size_mb)]
    return argv


def search_range(args: argparse.Namespace) -> tuple[int, int]:
    """(start, upper) in search units: images, or multiples of --size-step pixels."""
    upper_px = args.search_max or SEARCH_DEFAULT_MAX[args.search]
    if args.search == "batch":
        return min(args.search_start or args.batch_size, upper_px), upper_px
    start_px = args.search_start or args.image_size
    upper = max(1, upper_px // args.size_step)
    return max(1, min(start_px // args.size_step, upper)), upper


def ratio_text(with_lms: SearchResult, without: SearchResult) -> str:
    if without.largest == 0:
        return "without LMS nothing trains" if with_lms.largest else "nothing trains either way"
    ratio = with_lms.largest / without.largest
    return f"{ratio:.2f}x" + ("" if with_lms.exact and without.exact else " (lower bound)")


def run_search(args: argparse.Namespace, script: str | None = None) -> int:
    """Both searches; every probe runs ``script`` (default: this file) with --probe."""
    start, upper = search_range(args)
    unit = "batch" if args.search == "batch" else f"image size (x{args.size_step} px)"
    script = script or str(Path(__file__).resolve())
    results: dict[str, SearchResult] = {}
    for lms in (False, True):
        label = "with LMS" if lms else "without LMS"
        print(f"== largest {unit} {label}, cap {args.memory_cap_gb:g} GiB (start {start})")

        def command(value: int, lms: bool = lms) -> list[str]:
            return python_command(script, probe_argv(args, value, lms))

        probe = subprocess_probe(command, timeout_s=args.probe_timeout, log=print)
        results[label] = find_largest(
            probe, start, lower=1, upper=upper, rel_tol=args.search_tolerance
        )
    scale = 1 if args.search == "batch" else args.size_step
    without, with_lms = results["without LMS"], results["with LMS"]
    name = "batch" if args.search == "batch" else "image size"
    print(
        f"{args.model}: largest {name} without LMS: {_scaled(without, scale)}, "
        f"with LMS: {_scaled(with_lms, scale)}; ratio {ratio_text(with_lms, without)}"
    )
    if args.search_json is not None:
        args.search_json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "search": args.search,
                    "memory_cap_gb": args.memory_cap_gb,
                    "batch_size": args.batch_size,
                    "image_size": args.image_size,
                    **{
                        key.replace(" ", "_"): {
                            "largest": r.largest * scale,
                            "exact": r.exact,
                            "described": _scaled(r, scale),
                            "probes": [
                                {
                                    "value": p.value * scale,
                                    "outcome": p.outcome.value,
                                    "seconds": round(p.seconds, 2),
                                }
                                for p in r.probes
                            ],
                        }
                        for key, r in results.items()
                    },
                },
                indent=2,
            )
            + "\n"
        )
    return 0


def _scaled(result: SearchResult, scale: int) -> str:
    if scale == 1:
        return result.describe()
    return result.describe().replace(str(result.largest), str(result.largest * scale), 1)


def build_model(name: str, num_classes: int, image_size: int) -> Any:
    import torchvision.models as models

    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if name.startswith("vit_"):
        kwargs["image_size"] = image_size
    if name in ("inception_v3", "googlenet"):
        kwargs["aux_logits"] = False
        kwargs["init_weights"] = True
    return models.get_model(name, **kwargs)


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from lmsstats import LmsStatsLogger, format_summary

    from lmsbench.lms_setup import apply_lms, ensure_lms_api, is_oom, lms_available, memory_cap

    if not torch.cuda.is_available():
        print("ManyModel.py: no CUDA device", file=sys.stderr)
        return 2
    if args.lms:
        try:
            backend = ensure_lms_api()
        except LmsUnavailable as exc:
            print(f"ManyModel.py: {exc}", file=sys.stderr)
            return 2
    else:
        backend = "off"
    device = torch.device("cuda", torch.cuda.current_device())
    cap = None if args.memory_cap_gb is None else int(args.memory_cap_gb * GiB)
    logger = LmsStatsLogger(args.stats_csv)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if args.amp else contextlib.nullcontext()
    retries = args.oom_retries
    times: list[float] = []
    try:
        with memory_cap(cap):
            if lms_available():
                apply_lms(lms_settings(args, args.lms))
            with device:
                model = build_model(args.model, args.num_classes, args.image_size)
            if args.channels_last:
                model = model.to(memory_format=torch.channels_last)
            model.train()
            if args.optimizer == "sgd":
                optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            else:
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            if not args.quiet:
                cap_text = f"cap {args.memory_cap_gb:g} GiB" if cap else "no cap"
                print(
                    f"{args.model}: batch {args.batch_size}, {args.image_size}x"
                    f"{args.image_size}, {cap_text}, LMS {backend}"
                )
            generator = torch.Generator(device=device).manual_seed(0)
            step = 0
            while step < args.iterations:
                logger.begin()
                try:
                    images = torch.randn(
                        args.batch_size,
                        3,
                        args.image_size,
                        args.image_size,
                        device=device,
                        generator=generator,
                    )
                    if args.channels_last:
                        images = images.contiguous(memory_format=torch.channels_last)
                    labels = torch.randint(
                        0, args.num_classes, (args.batch_size,), device=device, generator=generator
                    )
                    with amp:
                        out = model(images)
                        logits = out.logits if hasattr(out, "logits") else out
                        loss = F.cross_entropy(logits, labels)
                    loss.backward()
                    del images, labels, out, logits
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    loss_value = float(loss.detach())
                    del loss
                except Exception as exc:
                    if retries > 0 and is_oom(exc):
                        retries -= 1
                        optimizer.zero_grad(set_to_none=True)
                        print(f"iteration {step}: out of memory, retrying")
                        continue
                    raise
                row = logger.step()
                assert row is not None
                times.append(row["seconds"])
                if not args.quiet:
                    print(_iteration_line(step, row, args.batch_size, loss_value), flush=True)
                step += 1
    except Exception as exc:
        logger.close()
        if is_oom(exc):
            print(f"{args.model}: out of memory: {str(exc).splitlines()[0] if str(exc) else ''}")
            return EXIT_OOM
        raise
    logger.close()
    timed = times[args.warmup :] if len(times) > args.warmup else times
    mean = sum(timed) / len(timed)
    print(
        f"{args.model}: batch {args.batch_size}: {mean * 1000:.1f} ms per iteration, "
        f"{args.batch_size / mean:.1f} images/s (mean of {len(timed)} iterations)"
    )
    if not args.quiet:
        print(format_summary(logger.summary(skip=args.warmup)))
        if args.stats_csv:
            print(f"wrote {args.stats_csv}")
        if args.stats_png:
            try:
                title = f"{args.model} batch {args.batch_size}"
                print(f"wrote {logger.plot(args.stats_png, title=title)}")
            except ImportError:
                print("no PNG: matplotlib is missing; run `lmsstats.py plot` on the CSV later")
    return 0


def _iteration_line(step: int, row: dict[str, float], batch: int, loss: float) -> str:
    text = (
        f"iteration {step:4d}: {row['seconds'] * 1000:8.1f} ms  {batch / row['seconds']:8.1f} "
        f"img/s  loss {loss:.4f}  allocated {row['allocated_bytes'] / GiB:.2f} GiB"
    )
    if row["pageout_count"] or row["pagein_count"] or row["pagedout_bytes"]:
        text += (
            f"  out {row['pageout_bytes'] / GiB:.2f} GiB ({int(row['pageout_count'])})"
            f"  in {row['pagein_bytes'] / GiB:.2f} GiB ({int(row['pagein_count'])})"
            f"  stall {row['stall_ms']:.1f} ms"
        )
    return text


def list_models() -> int:
    try:
        import torchvision.models as models
    except ImportError:
        print("ManyModel.py: torchvision is not installed", file=sys.stderr)
        return 2
    for name in models.list_models(module=models):
        print(name)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_models:
        return list_models()
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.search is not None:
        return run_search(args)
    started = time.monotonic()
    status = train(args)
    if args.probe:
        print(f"probe finished in {time.monotonic() - started:.1f} s with status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
