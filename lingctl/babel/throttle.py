"""Retries with jittered backoff, and AIMD concurrency for S3 requests.

Object stores answer overload with 503 SlowDown (or dropped connections). Retrying at the same concurrency
makes it worse, so every request goes through one shared ``Aimd`` gate: a throttled or dropped request
halves the number of requests allowed in flight (at most once per cooldown, since a burst of concurrent
failures reports the same event), each success adds 1/limit, so concurrency grows back by about one per
window of successes (TCP's additive-increase / multiplicative-decrease).
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

_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                             "ServiceUnavailable", "503"})


class RestartError(RetryableError):
    """Retryable, but not by sending the same request again: the whole object's copy must start over (its
    source changed under a pinned read, or the server forgot the multipart upload). The retrier passes it
    straight up to the copy, which restarts it a bounded number of times."""


@dataclass(slots=True)
class Counters:
    requests: int = 0
    retries: int = 0
    throttled: int = 0


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


def is_throttle(exc: BaseException) -> bool:
    """503 / SlowDown and dropped connections: the store asks us to slow down."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return err.get("Code") in _THROTTLE_CODES or status == 503
    name = type(exc).__name__
    return "Connection" in name or "Endpoint" in name or isinstance(exc, (ConnectionError, TimeoutError))


class Retrier:
    """Runs S3 calls through the AIMD gate, retrying retryable failures with exponential backoff and full
    jitter (so clients that failed together do not retry together)."""

    def __init__(self, gate: Aimd, translate: Callable[[BaseException, str, int], LingctlError], *,
                 attempts: int = 8, base_s: float = 0.05, cap_s: float = 5.0) -> None:
        self.gate = gate
        self.translate = translate
        self.attempts = max(1, attempts)
        self.base_s = base_s
        self.cap_s = cap_s
        self.counters = Counters()
        self._lock = threading.Lock()

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        for attempt in range(1, self.attempts + 1):
            self.gate.acquire()
            throttled = False
            try:
                with self._lock:
                    self.counters.requests += 1
                return fn(*args, **kwargs)
            except Exception as exc:
                throttled = is_throttle(exc)
                err = exc if isinstance(exc, LingctlError) else self.translate(exc, what, attempt)
                if isinstance(err, RestartError) or not (err.retryable or throttled) or attempt == self.attempts:
                    raise err from exc
                with self._lock:
                    self.counters.retries += 1
                    self.counters.throttled += throttled
                delay = random.uniform(0, min(self.cap_s, self.base_s * 2 ** attempt))
                log.debug("retrying %s in %.2fs after %s", what, delay, err)
            finally:
                self.gate.release(throttled=throttled)
            time.sleep(delay)
        raise AssertionError("unreachable")
