"""Benchmarks of the engine on its own: C++ programs built with the standalone c10 build, and
``schedule_replay`` (``python -m benchmarks.engine.schedule_replay``) on the simulated GPU."""
