"""Errors that reach the user, and the exit codes they map to.

Library code raises a ``LingctlError`` kind; ``lingctl.cli.main`` turns it into one line on stderr (plus a
hint when there is a next step to try) and the kind's exit code. Tracebacks are shown only with
``LINGCTL_DEBUG=1``. The codes are documented in docs/cli.md and are part of the interface:

    0 ok, 1 error, 2 usage, 3 not found, 4 verification failed, 5 retryable error that exhausted its retries
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_VERIFY = 4
EXIT_RETRIES_EXHAUSTED = 5
EXIT_INTERRUPTED = 130  # as a shell reports a job stopped by Ctrl-C


class LingctlError(Exception):
    """An error the user can act on. ``message`` is one line; ``hint`` says what to try next."""

    exit_code = EXIT_ERROR
    # Whether trying the same operation again may succeed (network blips, throttling, 5xx).
    retryable = False

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(LingctlError):
    """Bad flags, malformed URLs or configs: the command was asked for something it cannot mean."""

    exit_code = EXIT_USAGE


class NotFoundError(LingctlError):
    """A file, object, bucket or directory that should exist does not."""

    exit_code = EXIT_NOT_FOUND


class VerificationError(LingctlError):
    """Data differs from what it should be (checksums, sizes, missing objects)."""

    exit_code = EXIT_VERIFY


class Interrupted(LingctlError):
    """A long job stopped on request (Ctrl-C, SIGTERM) after saving what it needs to resume."""

    exit_code = EXIT_INTERRUPTED


class RetryableError(LingctlError):
    """A transient failure. Raised to the user only after its retries are spent, hence exit code 5."""

    exit_code = EXIT_RETRIES_EXHAUSTED
    retryable = True


class AccessDeniedError(LingctlError):
    """Credentials missing, wrong, or without permission. Not retryable: the same request fails again."""


class CertificateError(LingctlError):
    """A server's TLS certificate failed verification (unknown CA, wrong host name, expired). Not retryable:
    the next connection gets the same certificate, and going on would trust whoever holds the connection."""


class DiskFullError(LingctlError):
    """No space left, a quota or a file-size limit: permanent until the user frees space (exit 1)."""


def os_error(exc: OSError, what: str) -> LingctlError:
    """The user-facing kind of an ``OSError`` on ``what`` (a path), with the OS's reason in words."""
    import errno

    reason = (exc.strerror or str(exc)).lower()
    if exc.errno == errno.ENOENT:
        return NotFoundError(f"{what}: no such file or directory")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return AccessDeniedError(f"{what}: {reason}")
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG):
        return UsageError(f"{what}: {reason}")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        # Not retryable as it stands: the same write fails until space is freed or the limit raised.
        return DiskFullError(
            f"{what}: {reason}",
            hint="free space (or raise the file-size limit) and run the same command again; finished work is kept",
        )
    return LingctlError(f"{what}: {reason}")
