"""The one error type users see: a single line naming the problem and the fix."""


class GlanceError(Exception):
    """Bad input or environment; the CLIs print it as one line and exit non-zero."""
