"""The one exception type users see: a clear message, never a traceback."""


class SpecserveError(Exception):
    """A problem the user can fix (bad file, bad flag, bad request).

    The CLI prints the message and exits non-zero; the server answers HTTP 400.
    """
