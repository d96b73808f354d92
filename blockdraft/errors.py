"""User-facing errors: the CLI prints these as one line instead of a traceback."""


class BlockdraftError(Exception):
    """A problem with the user's input or set-up, explained in the message."""
