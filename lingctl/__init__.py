"""lingctl: train, move, watch, checkpoint and serve Ling-style Mixture-of-Experts models."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lingctl")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"
