"""The ``lingctl`` command: registers the tools; ``main`` turns errors into one line and an exit code."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer

from lingctl.commands.babel import app as babel_app
from lingctl.commands.doctor import doctor
from lingctl.commands.flood import app as flood_app
from lingctl.commands.pcache import app as pcache_app
from lingctl.commands.timer import app as timer_app
from lingctl.commands.train import app as train_app
from lingctl.commands.version import version
from lingctl.core.errors import EXIT_ERROR, EXIT_USAGE, LingctlError
from lingctl.core.logs import level_from, setup_logging
from lingctl.core.names import printable

app = typer.Typer(
    name="lingctl",
    help="Train, move, watch, checkpoint and serve Ling-style Mixture-of-Experts models.",
    no_args_is_help=True,
    add_completion=True,
    # Plain help: Rich markup would eat anything in square brackets ("[train] table", "ORG/NAME[@REV]").
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from lingctl import __version__

        typer.echo(f"lingctl {__version__}")
        raise typer.Exit()


_VERBOSE_HELP = "More logging (-vv for debug)."
_QUIET_HELP = "Only errors on stderr."
_LOG_FILE_HELP = "Write log records (-v: one per object copied) to FILE, appended to, instead of stderr."


@app.callback()
def root(
    verbose: Annotated[int, typer.Option("-v", "--verbose", count=True, show_default=False, help=_VERBOSE_HELP)] = 0,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help=_QUIET_HELP)] = False,
    log_file: Annotated[Path | None, typer.Option("--log-file", metavar="FILE", help=_LOG_FILE_HELP)] = None,
    show_version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    setup_logging(level_from(verbose, quiet), log_file)


app.add_typer(train_app, name="train")
app.add_typer(babel_app, name="babel")
app.add_typer(flood_app, name="flood")
app.add_typer(timer_app, name="timer")
app.add_typer(pcache_app, name="pcache")
app.command("doctor")(doctor)
app.command("version")(version)


def _global_flag(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """-v/-q given after a subcommand: add to what the root got and set the log level again. The root's own
    callback has already run (a group is invoked before its subcommand's arguments are parsed)."""
    if value:
        root_ctx = ctx.find_root()
        seen = root_ctx.meta.setdefault("lingctl.log_flags", {"verbose": 0, "quiet": False, "log_file": None})
        if param.name == "verbose":
            seen["verbose"] += value
        elif param.name == "log_file":
            seen["log_file"] = value
        else:
            seen["quiet"] = True
        verbose = (root_ctx.params.get("verbose") or 0) + seen["verbose"]
        quiet = bool(root_ctx.params.get("quiet")) or seen["quiet"]
        setup_logging(level_from(verbose, quiet), seen["log_file"] or root_ctx.params.get("log_file"))
    return value


def _global_flag_params() -> list[Any]:
    """The -v/-q options as parameters every subcommand can carry, built through Typer like any option."""
    holder = typer.Typer(add_completion=False)

    @holder.command()
    def flags(
        verbose: Annotated[
            int,
            typer.Option("-v", "--verbose", count=True, show_default=False, help=_VERBOSE_HELP, callback=_global_flag),
        ] = 0,
        quiet: Annotated[bool, typer.Option("-q", "--quiet", help=_QUIET_HELP, callback=_global_flag)] = False,
        log_file: Annotated[
            Path | None, typer.Option("--log-file", metavar="FILE", help=_LOG_FILE_HELP, callback=_global_flag)
        ] = None,
    ) -> None:
        pass

    params = list(typer.main.get_command(holder).params)
    for p in params:
        p.expose_value = False  # the command functions never see them; the callback sets the log level
    return params


def _with_global_flags(command: Any, flags: list[Any] | None = None) -> Any:
    """Accept the root's -v/-q/--log-file on every subcommand too (``lingctl babel ls DIR -v``), so they can go anywhere
    before ``--``. They are real options of each command, so the parser never takes another option's value
    for one, and each command's --help lists them."""
    flags = flags if flags is not None else _global_flag_params()
    for sub in getattr(command, "commands", {}).values():
        _with_global_flags(sub, flags)
        taken = {opt for p in sub.params for opt in [*p.opts, *p.secondary_opts]}
        if not taken & {"-v", "--verbose", "-q", "--quiet", "--log-file"}:  # a command's own option would win
            sub.params.extend(flags)
    return command


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
    command = _with_global_flags(typer.main.get_command(app))
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
        return _fail(
            f"internal error: {type(err).__name__}: {err}",
            "re-run with LINGCTL_DEBUG=1 for the traceback, and report it",
            EXIT_ERROR,
        )


def main() -> None:
    sys.exit(run())
