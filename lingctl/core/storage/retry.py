"""The one retry policy for S3 traffic: jittered exponential backoff, and AIMD concurrency.

Object stores answer overload with 503 SlowDown (or dropped connections). Retrying at the same concurrency
makes it worse, so every request goes through one shared ``Aimd`` gate: a throttled or dropped request
halves the number of requests allowed in flight (at most once per cooldown, since a burst of concurrent
failures reports the same event), each success adds 1/limit, so concurrency grows back by about one per
window of successes (TCP's additive-increase / multiplicative-decrease).

``THROTTLE_CODES`` is the one list of S3 error codes that mean "slow down": the retrier lowers concurrency
on them, and ``s3_errors.translate`` makes them retryable.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from lingctl.core.errors import LingctlError, RetryableError

log = logging.getLogger(__name__)
T = TypeVar("T")

THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "ServiceUnavailable",
        "TooManyRequests",
        "RequestThrottled",
    }
)
THROTTLE_STATUS = frozenset({429, 503})


class RestartError(RetryableError):
    """Retryable, but not by sending the same request again: the whole object's copy must start over (its
    source changed under a pinned read, or the server forgot the multipart upload). The retrier passes it
    straight up to the caller, which restarts the copy a bounded number of times."""


class SourceChangedError(RestartError):
    """The object is no longer the version a pinned read started from (overwritten, or removed)."""


class UploadGoneError(RestartError):
    """The server no longer knows the multipart upload (restarted, or a lifecycle rule aborted it)."""


@dataclass(slots=True)
class Counters:
    requests: int = 0  # sent, retries included
    retries: int = 0
    throttled: int = 0  # retries after a throttling reply or a dropped connection


class Aimd:
    def __init__(self, limit: int, *, minimum: int = 1, cooldown_s: float = 0.2) -> None:
        self.maximum = max(1, limit)
        self.minimum = minimum
        self.limit = float(self.maximum)
        self.inflight = 0
        self.cooldown_s = cooldown_s
        self._last_cut = 0.0
        self._cond = threading.Condition()
        self.lowest = self.limit

    def acquire(self) -> None:
        with self._cond:
            while self.inflight >= max(self.minimum, int(self.limit)):
                self._cond.wait()
            self.inflight += 1

    def release(self, *, throttled: bool = False) -> None:
        with self._cond:
            self.inflight -= 1
            now = time.monotonic()
            if throttled:
                if now - self._last_cut >= self.cooldown_s:
                    self.limit = max(float(self.minimum), self.limit / 2)
                    self.lowest = min(self.lowest, self.limit)
                    self._last_cut = now
            else:
                self.limit = min(float(self.maximum), self.limit + 1.0 / self.limit)
            self._cond.notify_all()


def backoff(attempt: int, base_s: float = 0.05, cap_s: float = 5.0) -> float:
    """The pause after failed attempt ``attempt``: exponential, with full jitter, so clients that failed
    together do not retry together."""
    return random.uniform(0, min(cap_s, base_s * 2**attempt))


def response_status(exc: BaseException) -> int:
    """The HTTP status of a botocore ``ClientError`` (0 for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def response_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` ("" for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", "") or "")


def is_throttle_reply(code: str, status: int) -> bool:
    return code in THROTTLE_CODES or status in THROTTLE_STATUS


def is_throttle(exc: BaseException) -> bool:
    """A throttling reply, or a dropped connection: the store asks us to slow down."""
    if isinstance(getattr(exc, "response", None), dict):
        return is_throttle_reply(response_code(exc), response_status(exc))
    name = type(exc).__name__
    return "Connection" in name or "Endpoint" in name or isinstance(exc, (ConnectionError, TimeoutError))


class Retrier:
    """Runs S3 calls through the AIMD gate, retrying retryable failures with exponential backoff and full
    jitter (so clients that failed together do not retry together). ``translate(exc, what, attempts)`` turns
    a failure into a lingctl error; only retryable ones (and throttling) are sent again.

    ``counters`` is where requests, retries and throttled retries are counted (default: a ``Counters`` of its
    own; a listing passes its ``ListStats``). ``stop``, when set during a backoff, ends the retries at once with
    the last error: a listing whose consumer went away must not keep sending requests."""

    def __init__(
        self,
        gate: Aimd,
        translate: Callable[[BaseException, str, int], LingctlError],
        *,
        attempts: int = 8,
        base_s: float = 0.05,
        cap_s: float = 5.0,
        counters: Counters | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.gate = gate
        self.translate = translate
        self.attempts = max(1, attempts)
        self.base_s = base_s
        self.cap_s = cap_s
        self.counters = counters if counters is not None else Counters()
        self.stop = stop
        self._lock = threading.Lock()

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return self._once(fn, *args, **kwargs)
            except Exception as exc:
                throttled = is_throttle(exc)
                err = exc if isinstance(exc, LingctlError) else self.translate(exc, what, attempt)
                if isinstance(err, RestartError) or not (err.retryable or throttled) or attempt == self.attempts:
                    raise err from exc
                with self._lock:
                    self.counters.retries += 1
                    self.counters.throttled += throttled
                delay = backoff(attempt, self.base_s, self.cap_s)
                log.debug("retrying %s in %.2fs after %s", what, delay, err)
                if self.stop is None:
                    time.sleep(delay)
                elif self.stop.wait(delay):
                    raise err from exc
        raise AssertionError("unreachable")

    def _once(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One request through the gate; a throttled or dropped one lowers the gate's limit."""
        self.gate.acquire()
        throttled = False
        try:
            with self._lock:
                self.counters.requests += 1
            return fn(*args, **kwargs)
        except Exception as exc:
            throttled = is_throttle(exc)
            raise
        finally:
            self.gate.release(throttled=throttled)
