"""The ``lingctl`` command: registers the tools; ``main`` turns errors into one line and an exit code."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated

import typer

from lingctl.commands.babel import app as babel_app
from lingctl.commands.flood import app as flood_app
from lingctl.commands.pcache import app as pcache_app
from lingctl.commands.timer import app as timer_app
from lingctl.commands.doctor import doctor
from lingctl.commands.train import train
from lingctl.commands.version import version
from lingctl.core.errors import EXIT_ERROR, EXIT_USAGE, LingctlError
from lingctl.core.logs import level_from, setup_logging
from lingctl.core.names import printable

app = typer.Typer(
    name="lingctl",
    help="Train, move, watch, checkpoint and serve Ling-style Mixture-of-Experts models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from lingctl import __version__

        typer.echo(f"lingctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    verbose: Annotated[int, typer.Option("-v", "--verbose", count=True, help="More logging (-vv for debug).")] = 0,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Only errors on stderr.")] = False,
    show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
) -> None:
    setup_logging(level_from(verbose, quiet))


app.command("train")(train)
app.add_typer(babel_app, name="babel")
app.add_typer(flood_app, name="flood")
app.add_typer(timer_app, name="timer")
app.add_typer(pcache_app, name="pcache")
app.command("doctor")(doctor)
app.command("version")(version)


def _fail(message: str, hint: str | None, code: int) -> int:
    # Messages quote names from data (object keys, paths): shown escaped, so the error stays one line.
    sys.stderr.write(f"lingctl: error: {printable(message)}\n")
    if hint:
        sys.stderr.write(f"hint: {printable(hint)}\n")
    sys.stderr.flush()
    return code


def run(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` and return the exit code (``main`` exits with it)."""
    debug = os.environ.get("LINGCTL_DEBUG", "") not in ("", "0")
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="lingctl", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except LingctlError as err:
        if debug:
            traceback.print_exc()
        return _fail(err.message, err.hint, err.exit_code)
    except typer.Abort:
        return _fail("aborted", None, 130)
    except typer.TyperException as err:  # usage errors from parsing: bad flags, missing arguments
        if type(err).__name__ == "NoArgsIsHelpError":  # a group called bare: its help is the answer
            sys.stdout.write(err.format_message() + "\n")
            return 0
        ctx = getattr(err, "ctx", None)
        hint = f"try '{ctx.command_path} --help'" if ctx is not None else "try 'lingctl --help'"
        message = " ".join(err.format_message().split())  # always one line
        return _fail(message, hint, getattr(err, "exit_code", EXIT_USAGE))
    except KeyboardInterrupt:
        return _fail("interrupted", None, 130)
    except BrokenPipeError:
        # The reader went away (``lingctl ... | head``): not worth a message. Point stdout at /dev/null so
        # the interpreter's final flush does not raise again (the recipe in Python's signal docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except Exception as err:  # a bug: one line for users, the traceback with LINGCTL_DEBUG=1
        if debug:
            traceback.print_exc()
        return _fail(f"internal error: {type(err).__name__}: {err}",
                     "re-run with LINGCTL_DEBUG=1 for the traceback, and report it", EXIT_ERROR)


def main() -> None:
    sys.exit(run())
