"""Ctrl-C and SIGTERM as real signals to this process: the first is a request, the second an abort."""

from __future__ import annotations

import signal
import threading

import pytest

from lingctl.core.graceful_stop import GracefulStop, graceful_stop


def _deliver(sig: int) -> None:
    """Send ``sig`` to this thread (the main one): it is delivered before pthread_kill returns, and Python runs
    the handler before the next line."""
    signal.pthread_kill(threading.get_ident(), sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_requests_a_stop_once_and_the_second_aborts(sig: int) -> None:
    said: list[str] = []
    stop = GracefulStop(lambda: said.append("stopping"))
    with graceful_stop(stop):
        assert stop() is False
        _deliver(sig)
        assert stop() is True and said == ["stopping"]
        with pytest.raises(KeyboardInterrupt):
            _deliver(sig)
    assert said == ["stopping"]


def test_before_it_is_armed_a_signal_aborts_at_once() -> None:
    stop = GracefulStop(armed=False)
    with graceful_stop(stop):
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGTERM)
        assert stop() is False
        stop.arm()
        _deliver(signal.SIGTERM)
        assert stop() is True


def test_the_previous_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = GracefulStop()
    with graceful_stop(stop):
        assert signal.getsignal(signal.SIGTERM) == stop._on_signal
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_request_from_code_is_the_same_stop_and_a_worker_thread_installs_nothing() -> None:
    said: list[int] = []
    stop = GracefulStop(lambda: said.append(1))
    stop.request()
    stop.request()
    assert stop() and said == [1]
    seen: list[object] = []

    def in_thread() -> None:
        with graceful_stop(GracefulStop()):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen == [before]
