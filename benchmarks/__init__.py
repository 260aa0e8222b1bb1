"""The benchmarks of Large Model Support, each module a command line (``--help``).

Run them from the repository root as modules, ``python -m benchmarks.compare ...``; as
scripts (``python benchmarks/compare.py ...``) they need the checkout installed (``make venv``)
or on ``PYTHONPATH``. What they share with the examples and the tests is in ``lmsbench``.
"""
