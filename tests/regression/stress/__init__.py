"""Randomized stress suite of Large Model Support: generated models trained under memory caps.

``generator`` describes a case from its seed (no torch needed), ``models`` builds it,
``allocator`` holds the caching allocator's rounding and settings (no torch needed),
``worker`` trains one case in one process and writes a JSON result, and ``runner`` runs the
references and the capped runs (with LMS and without) of each case in separate processes,
classifies the outcome and writes ``results.jsonl`` and ``summary.md``. See ``python -m
tests.regression.stress.runner --help``. ``optrace`` traces, on a GPU, what chosen operators
of one case allocate inside themselves, to compare a failing capped run with its reference.

What the suite shares with the benchmarks and the regression matrix (a run in a process of its
own under a time limit, the shared record schema, the gate's classes) is in ``lmsbench``.
"""
