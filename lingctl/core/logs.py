"""Logging set-up, done once by ``lingctl.cli.main``. Library code only calls ``logging.getLogger(__name__)``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from lingctl.core.errors import os_error
from lingctl.core.names import printable

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def level_from(verbose: int, quiet: bool) -> int:
    """-v gives INFO, -vv DEBUG, -q only errors; LINGCTL_LOG_LEVEL wins when set (useful under torchrun)."""
    env = os.environ.get("LINGCTL_LOG_LEVEL", "").strip().lower()
    if env in _LEVELS:
        return _LEVELS[env]
    if quiet:
        return logging.ERROR
    return {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)


class _Printable(logging.Filter):
    """Escapes control characters in every record: messages carry object keys and paths from data, and an ESC
    sequence or a newline in one must not rewrite the terminal or forge a log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a malformed call: leave it to the handler's own error report
            return True
        record.msg, record.args = printable(message), None
        return True


def setup_logging(level: int = logging.WARNING, log_file: Path | None = None) -> None:
    """Log to stderr: Rich formatting on a terminal, plain ``lingctl: LEVEL name: message`` lines otherwise.
    With ``log_file`` (``--log-file``, as rclone's): to that file instead, appended to, one timestamped line per
    record; the command's one-line error still goes to stderr."""
    root = logging.getLogger("lingctl")
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    handler: logging.Handler
    if log_file is not None:
        try:
            handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        except OSError as exc:
            raise os_error(exc, f"--log-file {log_file}") from None
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elif sys.stderr.isatty():
        from rich.logging import RichHandler

        handler = RichHandler(show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("lingctl: %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_Printable())
    root.addHandler(handler)
    root.setLevel(level)
    # Our records stop here; botocore and friends keep their own (quiet) defaults.
    root.propagate = False
