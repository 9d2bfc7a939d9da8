"""The kvcli command line: a thin click layer over the library.

stdout carries only answers (or --json); progress, statistics and warnings go to stderr.
Exit codes: 0 success, 1 internal error, 2 bad input (one line on stderr), 130 interrupted (Ctrl-C, and SIGTERM
or SIGHUP, which finish as Ctrl-C does: `terminate_as_interrupt`).
Each command lives in kvcli/commands/<name>.py and is listed in COMMANDS.
"""
from __future__ import annotations

import importlib
import os
import re
import signal
import sys

import click

from kvcli import __version__
from kvcli.errors import KvcliError, Terminated

# what only the reference engine imports (pip install 'kvcli[reference]'); the native path never does
REFERENCE_MODULES = ("torch", "transformers", "accelerate")
COMMANDS = ["run", "info", "check", "policies", "chat", "compress", "bench", "eval", "calibrate", "batch",
            "documents", "serve"]


def usage_line(e: click.UsageError) -> str:
    """A click usage error as one line: "--budget: 'abc' is not an integer" (click prints three)."""
    if isinstance(e, click.BadParameter) and not isinstance(e, click.MissingParameter) and e.param is not None:
        longs = [o for o in getattr(e.param, "opts", []) if o.startswith("--")]
        name = max(longs, key=len) if longs else e.param.human_readable_name
        msg = re.sub(r"is not a valid (integer|float)( range)?",
                     lambda m: "is not an integer" if m[1] == "integer" else "is not a number", e.message)
        return f"{name}: {msg.rstrip('.')}"
    return " ".join(e.format_message().split()).rstrip(".")


class KvcliGroup(click.Group):
    """Turns every failure into one line on stderr and an exit code; never a traceback."""

    def main(self, args=None, prog_name=None, **extra):
        """click's standalone handling, but a usage error is one line (`kvcli: error: ...`, exit 2)."""
        extra.pop("standalone_mode", None)
        try:
            rv = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:   # bare `kvcli eval`: the help, as click shows it
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            click.echo(f"kvcli: error: {usage_line(e)}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvcliError as e:
            click.echo(f"kvcli: error: {e}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            try:   # after SIGHUP the terminal may be gone: the exit status says it
                click.echo("kvcli: interrupted" if Terminated.signum is None else
                           f"kvcli: stopped by {signal.Signals(Terminated.signum).name}", err=True)
            except OSError:
                pass
            ctx.exit(130)
        except BrokenPipeError:  # `kvcli run ... | head`: the reader left, nothing to report
            sys.stderr.close()
            ctx.exit(0)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except OSError as e:  # a path the user gave that the system refuses (name too long, no permission...)
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"kvcli: error: {where}{e.strerror or e}", err=True)
            ctx.exit(2)
        except Exception as e:  # a bug of ours: say so in one line, the traceback is one variable away
            if isinstance(e, ImportError) and (e.name or "").split(".")[0] in REFERENCE_MODULES:
                # a reference-engine path reached without the extra (each checks first: kvcli/reference/__init__.py)
                click.echo(f"kvcli: error: this needs the reference engine ({e.name} is not installed): "
                           "pip install 'kvcli[reference]'", err=True)
                ctx.exit(2)
            if os.environ.get("KVCLI_DEBUG"):
                raise
            click.echo(f"kvcli: internal error: {type(e).__name__}: {e} (KVCLI_DEBUG=1 shows the traceback)",
                       err=True)
            ctx.exit(1)


@click.group(cls=KvcliGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvcli")
def cli():
    """Compress an LLM's KV cache at prefill time and chat with, summarise and benchmark long documents
    on a local GGUF model (llama.cpp, patched; PyTorch reference engine for cross-checks)."""


for _name in COMMANDS:
    for _cmd in importlib.import_module(f"kvcli.commands.{_name}").COMMANDS:
        cli.add_command(_cmd)


def terminate_as_interrupt() -> None:
    """SIGTERM (kill, timeout, a service manager) and SIGHUP (the terminal closed) raise Terminated, a
    KeyboardInterrupt: the process cleans up as after Ctrl-C (a temporary store removed, kvcli/document_store.py)
    instead of dying where it stands. Python runs the handler between bytecodes, so native work (a llama_decode)
    finishes first, as with Ctrl-C."""
    def handler(signum, frame):
        first = Terminated.signum is None
        Terminated.signum = signum
        if first:   # a second signal while cleaning up must not cut the cleanup short
            raise Terminated()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:   # `nohup kvcli ...` ignores SIGHUP: it still does
            signal.signal(sig, handler)


def main() -> None:
    terminate_as_interrupt()
    cli(prog_name="kvcli")


if __name__ == "__main__":
    main()
