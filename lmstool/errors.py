"""Errors the CLI reports to the user as one clear message (no traceback)."""


class LmsToolError(Exception):
    """A user-facing error: the message says what was wrong and what to do."""
