"""Traces every Python process started under ``lingctl timer run`` (this directory is first on PYTHONPATH).

With ``LINGCTL_TIMER_OUT`` set, installs the tracer, then runs the ``sitecustomize`` this one shadows, if any.
Nothing here may stop the process from starting: errors become one line on stderr.
"""

import os
import sys


def _trace() -> None:
    out = os.environ.get("LINGCTL_TIMER_OUT")
    if not out:
        return
    try:
        from lingctl.timer import install

        install(out, targets=os.environ.get("LINGCTL_TIMER_TARGETS") or None)
    except Exception as exc:
        sys.stderr.write(f"lingctl timer: pid {os.getpid()} is not traced: {exc!r}\n")


def _chain() -> None:
    try:
        import importlib.util
        from importlib.machinery import PathFinder

        here = os.path.dirname(os.path.abspath(__file__))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = PathFinder.find_spec("sitecustomize", path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write(f"lingctl timer: the next sitecustomize failed: {exc!r}\n")


_trace()
_chain()
