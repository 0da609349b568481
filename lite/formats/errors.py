"""The error type for problems a user can fix (bad paths, unsupported models, bad options)."""


class LiteturboError(ValueError):
    """A problem with the user's input; the message names the problem and the fix.

    The CLI prints it without a traceback and exits with status 2.
    """
