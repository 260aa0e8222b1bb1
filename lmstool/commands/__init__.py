"""CLI commands: each module exposes ``register(subparsers)``."""
