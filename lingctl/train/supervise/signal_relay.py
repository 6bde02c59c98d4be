"""The launcher's signals, passed on to the attempt's processes as torchrun passes its own to its workers.

torchrun runs in a session of its own (``start_new_session``), as the workers it starts do, so a signal
reaches the job only through the launcher, and each process gets it once, whoever sent it: Ctrl-C at the
terminal (the launcher's process group), ``kill -INT PID`` or ``kill -TERM PID`` from a user or a scheduler
(the launcher alone), or a terminal that closed (SIGHUP). Were torchrun in the launcher's process group, a
Ctrl-C would reach it directly and a copy from the launcher would be a second Ctrl-C (abort at once), while
``kill -INT PID`` would reach the launcher alone and stop nothing.

- The first signal goes to torchrun, which passes it to every worker: each finishes its step, saves what
  ``--resume`` needs and exits 130.
- A later one goes straight to the workers, which abort at once (a second Ctrl-C): torchrun, busy stopping
  them by then, does not pass on another.
- SIGHUP is passed on as SIGTERM: nobody is left to read the terminal, and the job stops as cleanly as when
  asked to.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SignalRelay:
    """Notes the signals the launcher gets while it is entered (a context manager, in the main thread), and
    passes them on to an attempt's torchrun with :meth:`pass_on`, which the launcher's loop calls as it polls."""

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self._passed = 0
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def stopping(self) -> bool:
        return bool(self.received)

    def __enter__(self) -> SignalRelay:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only noted: the loop that polls the attempt passes it on, so a signal arriving while that loop is
        # passing on another never interleaves with it.
        self.received.append(signal.SIGTERM if signum == signal.SIGHUP else signal.Signals(signum))

    def pass_on(self, proc: subprocess.Popen) -> None:
        """Send ``proc`` (the attempt's torchrun) the signals it has not had: the first to it, later ones to
        its workers."""
        while self._passed < len(self.received) and proc.poll() is None:
            sig = self.received[self._passed]
            self._passed += 1
            if self._passed == 1:
                proc.send_signal(sig)
            else:
                _to_children(proc.pid, sig)


def _to_children(pid: int, sig: signal.Signals) -> None:
    import psutil

    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return
    for child in children:
        try:
            child.send_signal(sig)
        except psutil.Error:  # gone meanwhile
            pass
