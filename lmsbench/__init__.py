"""What the benchmarks (``benchmarks/``), the examples (``examples/``) and the tests share.

- :mod:`lmsbench.lms_setup`: the ``torch.cuda`` LMS API (a patched PyTorch, or the drop-in
  extension), its settings, memory caps, deterministic runs, versions and provenance, the
  option types of the command lines;
- :mod:`lmsbench.search`: the largest-value search (batch, image size) over probes that each
  run in a process of their own;
- :mod:`lmsbench.harness`: a workload in a process of its own under a time limit, the options
  every tool takes, one record schema with provenance;
- :mod:`lmsbench.models`: the GPT-style decoder and the torchvision ResNets that the benchmark,
  the regression suite and its matrix build;
- :mod:`lmsbench.matrix_cells`: the cells of the regression matrix's tables;
- :mod:`lmsbench.stress_gate`: the stress suite's record classes and its gate;
- :mod:`lmsbench.trace_gen`: operator traces for the engine on the simulated GPU.

``make venv`` installs it with the tooling (``pip install -e '.[test]'``). On a copy of the
tree that is not installed (a GPU host), run from the repository root with ``python -m``, or
put the root on ``PYTHONPATH``. Only :mod:`lmsbench.models` imports torch when imported; the
others import it where they use it, so they work on a machine without torch.
"""
