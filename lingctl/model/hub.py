"""``--model DIR|ORG/NAME[@REV]``: a local checkpoint directory, or a Hugging Face Hub model id resolved to its
snapshot directory in the Hugging Face cache.

Resolution, in order:

1. A path that exists is used as it is, even when it also reads as an id (``org/name`` relative to the
   working directory): a local directory wins, as in transformers' ``from_pretrained``.
2. Otherwise a value shaped like a Hub id (``org/name``, the Hub's characters; optional ``@REV`` naming a
   branch, a tag or a 40-hex commit) is looked up through ``huggingface_hub`` in the cache that
   ``HF_HUB_CACHE`` names, else ``HF_HOME/hub`` (default ``~/.cache/huggingface/hub``). The variables are read
   at each call, not when ``huggingface_hub`` was imported.
3. Anything else is an error naming the value.

Online (``HF_HUB_OFFLINE`` unset), an id behaves as in vLLM and transformers: the Hub at ``HF_ENDPOINT`` is
asked which commit the revision names, missing files are downloaded into the cache (``HF_TOKEN`` for
private or gated models) and the snapshot is returned. Only what a model directory needs is fetched:
``config.json``, ``generation_config.json``, safetensors weights and their index, the tokenizer files and
the chat template, at the top of the repository; never pickled weights (``*.bin``, ``*.pt``) or code. A
commit hash whose snapshot is already cached is used without asking the Hub (a commit never changes).

The first request to the Hub waits at most ``HF_HUB_ETAG_TIMEOUT`` seconds (default 10). When the Hub cannot
be reached, or answers with a server error, the cached snapshot of the revision is used, as
``huggingface_hub`` itself does. Offline (``HF_HUB_OFFLINE=1``, or ``TRANSFORMERS_OFFLINE=1``), only the cache
is read. An id that is not cached then fails with one line naming the id, the revision and the cache
directory looked in, and a hint: ``hf download ORG/NAME`` on a machine with network, or unset
``HF_HUB_OFFLINE``. A cached snapshot without ``config.json`` is an error naming what is missing.

``huggingface_hub`` is imported only when an id is resolved, and every exception it raises becomes a one-line
``LingctlError``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.errors import AccessDeniedError, LingctlError, NotFoundError, os_error

# A snapshot is a model directory when it holds this file.
CONFIG_FILE = "config.json"
# What a model directory is made of in the Hugging Face layout (lingctl.flood.weights.model_dir, lingctl.model.checkpoint):
# downloading stops there. The names are lingctl.model.checkpoint_files' (core sits below model, so it cannot
# import them); tests/model/test_checkpoint_files.py checks that these patterns keep matching them.
MODEL_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# Files in sub-folders (``original/``, ``onnx/``...) are other formats of the same model; the reader ignores them.
SKIP_FILES = ("*/*",)
DEFAULT_REVISION = "main"
DEFAULT_ETAG_TIMEOUT_S = 10.0

# The Hub's repository names (huggingface_hub's validate_repo_id): ASCII letters, digits, '-', '_', '.';
# not starting or ending with '-' or '.'; at most 96 characters; no '--' or '..'. An org is required here:
# a bare ``name`` is too easily a typo of a local directory or a preset.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_REPO_ID_RE = re.compile(rf"{_PART}/{_PART}")
# Branches and tags as git allows them, kept to characters that are safe in a path (refs/<revision> in the
# cache); segment rules are checked in _valid_revision.
_REVISION_RE = re.compile(r"[A-Za-z0-9._+/-]{1,255}")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class HubId:
    repo_id: str  # org/name
    revision: str | None  # branch, tag or commit hash; None: the default branch

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_repo_id(spec: str) -> HubId | None:
    """``org/name[@rev]`` split into its parts, or None when ``spec`` is not shaped like a Hub model id."""
    repo_id, at, revision = spec.partition("@")
    if not _REPO_ID_RE.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return None
    if at and not _valid_revision(revision):
        return None
    return HubId(repo_id, revision if at else None)


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` has the form of a Hub model id, ``org/name`` with an optional ``@revision`` (syntax only;
    nothing is looked up)."""
    return parse_repo_id(spec) is not None


def _valid_revision(revision: str) -> bool:
    if not _REVISION_RE.fullmatch(revision) or ".." in revision or revision.endswith(".lock"):
        return False
    return all(part and not part.startswith(".") for part in revision.split("/"))


def resolve_model_dir(spec: str | Path, *, option: str = "--model") -> Path:
    """The directory ``spec`` names: an existing path as it is, else a Hub id's snapshot in the Hugging Face
    cache (downloaded first when online and missing; see the module docstring). ``option`` is the flag named
    in errors."""
    path = Path(spec)
    if path.exists():
        return path
    hub_id = parse_repo_id(str(spec))
    if hub_id is None:
        raise NotFoundError(
            f"{option} {spec}: no such directory, nor a Hugging Face model id",
            hint="give a checkpoint directory or a model id ORG/NAME[@REVISION]",
        )
    return _snapshot(hub_id, option)


# -- settings, read at each call --------------------------------------------------------------------------
def hub_cache_dir() -> Path:
    """The Hugging Face hub cache in the order huggingface_hub reads it: ``HF_HUB_CACHE``, the older
    ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME/hub``, ``XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _etag_timeout() -> float:
    try:
        value = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or DEFAULT_ETAG_TIMEOUT_S)
    except ValueError:
        return DEFAULT_ETAG_TIMEOUT_S
    return value if value > 0 else DEFAULT_ETAG_TIMEOUT_S


def _endpoint() -> str | None:
    value = os.environ.get("HF_ENDPOINT")
    return value.rstrip("/") if value else None


# -- resolution ---------------------------------------------------------------------------------------------
def _snapshot(hub_id: HubId, option: str) -> Path:
    try:
        from huggingface_hub import snapshot_download  # lazy: most commands never need it
    except ImportError:
        raise LingctlError(
            f"{option} {hub_id} reads as a Hugging Face model id, but huggingface_hub is not installed",
            hint="pip install huggingface_hub, or give a local directory",
        ) from None
    repo_id, revision = hub_id.repo_id, hub_id.revision or DEFAULT_REVISION
    cache = hub_cache_dir()
    where = f"{option} {repo_id}@{revision}"
    get = f"'hf download {repo_id} --revision {revision}' (older releases: 'huggingface-cli download')"
    if _COMMIT_RE.fullmatch(revision):
        cached = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / revision
        if (cached / CONFIG_FILE).is_file():
            return cached
    refused: Exception | None = None  # the Hub's answer when it would not serve the model
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set"
        hint = f"unset HF_HUB_OFFLINE to download it, or download it where the Hub is reachable: {get}"
    else:
        problem = _ask_hub(repo_id, revision)
        if problem is None:
            return _checked(_download(snapshot_download, repo_id, revision, cache, where, local_only=False), where, get)
        kind, exc = problem
        if kind == "revision":
            raise _hub_error(kind, exc, where, revision, repo_id)
        refused = exc if kind in ("repo", "denied") else None
        status = _status(exc)
        reason = (
            f"the Hub at {_endpoint_shown()} answered HTTP {status}"
            if status is not None
            else f"the Hub at {_endpoint_shown()} could not be reached ({_one_line(exc)})"
        )
        hint = f"check the network, HF_ENDPOINT and the proxy settings; or download it first: {get}"
    try:
        folder = _download(snapshot_download, repo_id, revision, cache, where, local_only=True)
    except _NotCached as missing:
        if refused is not None:  # not cached, and the Hub said why it will not serve it
            raise _hub_error(_kind(refused), refused, where, revision, repo_id) from None
        state = "incomplete in" if missing.incomplete else "not in"
        raise NotFoundError(
            f"{where}: not a local directory, and {state} the Hugging Face cache {cache}; {reason}", hint=hint
        ) from None
    return _checked(folder, where, get)


class _NotCached(Exception):
    def __init__(self, incomplete: bool) -> None:
        super().__init__()
        self.incomplete = incomplete


def _ask_hub(repo_id: str, revision: str) -> tuple[str, Exception] | None:
    """None when the Hub knows ``repo_id`` at ``revision``; otherwise the kind of failure and the exception.

    ``snapshot_download`` asks the Hub without a time limit, so a network that drops packets would hold it
    for minutes; this first request has one (``HF_HUB_ETAG_TIMEOUT``)."""
    from huggingface_hub import HfApi

    try:
        HfApi(endpoint=_endpoint()).repo_info(repo_id, revision=revision, timeout=_etag_timeout())
    except Exception as exc:
        return _kind(exc), exc
    return None


def _download(
    snapshot_download: Any, repo_id: str, revision: str, cache: Path, where: str, *, local_only: bool
) -> Path:
    """``snapshot_download`` of the model files; a snapshot missing from the cache raises ``_NotCached``."""
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=local_only,
            allow_patterns=list(MODEL_FILES),
            ignore_patterns=list(SKIP_FILES),
            endpoint=_endpoint(),
            etag_timeout=_etag_timeout(),
        )
    except Exception as exc:
        kind = _kind(exc)
        if kind == "missing":
            raise _NotCached(type(exc).__name__ == "IncompleteSnapshotError") from None
        raise _hub_error(kind, exc, where, revision, repo_id) from None
    return Path(folder)


def _checked(folder: Path, where: str, get: str) -> Path:
    if not (folder / CONFIG_FILE).is_file():
        raise NotFoundError(
            f"{where}: the cached snapshot {folder} has no {CONFIG_FILE}, so it is not a model directory",
            hint=f"download the model again: {get}",
        )
    return folder


def _hub_error(kind: str, exc: Exception, where: str, revision: str, repo_id: str) -> LingctlError:
    """One line for an exception from huggingface_hub."""
    if kind == "revision":
        return NotFoundError(
            f"{where}: the Hub has no revision {revision!r} of {repo_id}",
            hint="check the branch, tag or commit after '@'",
        )
    if kind == "repo":
        return NotFoundError(
            f"{where}: not a local directory, and no such model on the Hub at "
            f"{_endpoint_shown()} (or it is private or gated)",
            hint="check the id; for a private or gated model set HF_TOKEN (or run 'hf auth login')",
        )
    if kind == "denied":
        return AccessDeniedError(
            f"{where}: the Hub at {_endpoint_shown()} refused access ({_one_line(exc)})",
            hint="set HF_TOKEN to a token that can read this model",
        )
    if kind == "unreachable":
        return LingctlError(
            f"{where}: the Hub at {_endpoint_shown()} could not be reached ({_one_line(exc)})",
            hint="check the network, HF_ENDPOINT and the proxy settings, or set HF_HUB_OFFLINE=1 to use only the cache",
        )
    if isinstance(exc, OSError) and exc.errno is not None:
        return os_error(exc, f"{where}: {exc.filename or 'the Hugging Face cache'}")
    return LingctlError(f"{where}: {type(exc).__name__}: {_one_line(exc)}")


def _kind(exc: Exception) -> str:
    """What a huggingface_hub exception means, told by class names and the HTTP status: the same across its
    0.x and 1.x releases, whose HTTP clients (requests, httpx) and modules differ."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "RevisionNotFoundError" in names:
        return "revision"
    if names & {"RepositoryNotFoundError", "GatedRepoError"}:
        return "repo"
    if "LocalEntryNotFoundError" in names:
        return "missing"
    if "HfHubHTTPError" in names:
        return "denied" if _status(exc) in (401, 403) else "unreachable"
    if names & {
        "OfflineModeIsEnabled",
        "ConnectionError",
        "TimeoutError",
        "TimeoutException",
        "TransportError",
        "RequestError",
        "RequestException",
    }:
        return "unreachable"
    return "other"


def _status(exc: Exception) -> int | None:
    """The HTTP status of an error the Hub (or whatever answers at HF_ENDPOINT) returned, if it returned one."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _endpoint_shown() -> str:
    if (endpoint := _endpoint()) is not None:
        return endpoint
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's text, shortened: huggingface_hub's messages span several lines."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return text if len(text) <= limit else text[: limit - 3] + "..."
