"""User-facing errors: the CLI prints them as one line on stderr and exits with code 2."""


class KvcliError(Exception):
    """A problem with the user's input or set-up, explained in one line."""

    exit_code = 2
