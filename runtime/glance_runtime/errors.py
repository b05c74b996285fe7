"""The one error type users see: a single line naming the problem and the fix."""


class GlanceError(Exception):
    """Bad input or environment; the CLIs print it as one line and exit non-zero."""


class InputError(GlanceError):
    """The caller's prompt, messages, images or flags cannot be served as given."""


class LimitError(GlanceError):
    """The request exceeds what the loaded graphs or buffers hold (context, tree size, top-k)."""


class IntegrityError(GlanceError):
    """Artifacts or engines on disk fail their checks (hashes, manifest, format version)."""
