"""lmstool: patch-series, build and packaging tooling for PyTorch Large Model Support."""

__version__ = "0.1.0"
