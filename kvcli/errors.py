"""User-facing errors: the CLI prints them as one line on stderr and exits with code 2."""


class KvcliError(Exception):
    """A problem with the user's input or set-up, explained in one line."""

    exit_code = 2


class ContextFull(KvcliError):
    """The context has no room for the next tokens: either engine's session raises it (kvcli/session.py), so one
    `except` catches both."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (kvcli/cli.py): the process finishes as Ctrl-C finishes it (every `finally` and
    `except KeyboardInterrupt` cleans up, exit 130), but a chat does not stay at its prompt as it does after Ctrl-C."""

    signum: int | None = None   # set when one arrived: code that catches KeyboardInterrupt asks `Terminated.signum`
