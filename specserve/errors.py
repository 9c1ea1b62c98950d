"""The one exception type users see: a clear message, never a traceback."""


class SpecserveError(Exception):
    """A problem the user can fix (bad file, bad flag, bad request).

    The CLI prints the message and exits non-zero; the server answers HTTP 400.
    """


class NotSupported(SpecserveError):
    """Something this set-up cannot do (a remote host's runner, tensor parallelism, a server flag not
    given): the server answers 501 `not_supported_error`, as llama-server does."""
