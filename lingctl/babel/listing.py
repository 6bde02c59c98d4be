"""Fast, parallel listing of whole trees: a local directory or everything under an S3 prefix.

Listing is what a sync of millions of objects waits on first. botocore's paginator spends most of its time
parsing timestamps with dateutil, so the S3 side sends its own signed ListObjectsV2 GETs and parses the XML
with a few compiled regexes. One prefix lists serially page by page, so the key space is split to list in
parallel: every common prefix of a delimiter listing becomes its own task, and a prefix whose first page is
truncated (a flat directory of many keys) is cut into StartAfter ranges that list side by side, each range
splitting again when it is itself large. Results come back in batches while listing goes on, so a consumer
can start comparing or copying early; batches arrive in no particular order.

``rclone serve s3`` (the test server) honours start-after and encoding-type=url, but builds every reply from
the whole directory (and by default reads every file in it for an MD5 ETag), so a request costs time in
proportion to the directory, not the page. Splitting a flat directory there multiplies the server's work
instead of dividing the wait; the lister measures what parallel requests gain and stops splitting when the
gain is small (see ``_MIN_GAIN``).
"""

from __future__ import annotations

import html
import logging
import os
import queue
import random
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, unquote_plus, urlparse

from lingctl.core.atomic import TMP_MARKER
from lingctl.core.errors import NotFoundError, UsageError, os_error
from lingctl.core.storage.s3 import S3Options, translate
from lingctl.core.storage.url import StoreURL, parse_url

log = logging.getLogger(__name__)

_BATCH = 1000  # local entries per batch; S3 batches are pages, which hold at most 1000 keys
_PAGE = 1000  # ListObjectsV2 max-keys: S3 and rclone cap it at 1000
_MIN_ATTEMPTS = 5  # a long listing meets more transient errors than a single request does
_BACKOFF_BASE, _BACKOFF_CAP = 0.1, 5.0
_RETRY_STATUS = frozenset({500, 502, 503, 504})
_RETRY_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"})

# Characters where range boundaries are placed, by the kind of name seen on a page: the smallest class that
# covers the page's characters, so numbered or hashed keys do not spend requests on ranges that hold nothing.
# Boundaries only balance the work; every key outside the class still falls in some range.
_ALPHABETS = ("0123456789", "0123456789abcdef", "-.0123456789_abcdefghijklmnopqrstuvwxyz",
              "-./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz~")
# Splitting a range costs extra requests (the tail of each range, ranges that turn out empty): worth it
# only while parallel requests finish at least this many times faster than one after another.
_MIN_GAIN = 2.0
_FIRST_SPLIT = 4  # ranges per split until the gain is measured
_SPLIT_LEVELS = 3  # character positions, counted back from the page's common prefix, that get boundaries


@dataclass(slots=True)
class Listed:
    key: str  # relative to the root URL's prefix, '/'-separated
    size: int
    mtime: float  # seconds since the epoch (S3 LastModified, or local st_mtime)
    etag: str | None = None


@dataclass(slots=True)
class ListStats:
    requests: int = 0  # HTTP List requests sent, retries included (S3) / directories scanned (local)
    retries: int = 0
    objects: int = 0


def list_tree(url: StoreURL | str, s3: S3Options | None = None, *, jobs: int = 16, stats: ListStats | None = None,
              skip_dirs: frozenset[str] = frozenset()) -> Iterator[list[Listed]]:
    """Every object under url (recursively), in batches, in no particular order.

    The root is checked (and S3 credentials resolved) at once; listing starts on the first ``next()``.
    Directories (local) or common prefixes (S3) named in ``skip_dirs`` are skipped at any depth. Raises
    ``NotFoundError`` (no such directory or bucket), ``AccessDeniedError``, ``UsageError`` (the root is a
    file, bad options) and, once its retries are spent, ``RetryableError``. Stopping the iteration early
    stops the workers.
    """
    root = parse_url(url) if isinstance(url, str) else url
    if jobs < 1:
        raise UsageError(f"jobs must be >= 1, got {jobs}")
    stats = stats if stats is not None else ListStats()
    if root.is_s3:
        s3_lister = _S3Lister(root, s3 or S3Options(), jobs, skip_dirs)
        return _Crawl(jobs, stats, s3_lister.page, s3_lister.close).run(_Range(s3_lister.prefix))
    local = _LocalLister(root, skip_dirs)
    return _Crawl(jobs, stats, local.scan).run((local.root, ""))


class _Crawl:
    """Worker threads whose tasks may add more tasks; batches come back through a bounded queue.

    The bound is backpressure: a consumer slower than the listing holds the workers instead of memory.
    The workers are daemon threads, unlike a ThreadPoolExecutor's: a listing abandoned without close()
    (its generator kept alive by a traceback) must not hold up the interpreter's exit.
    """

    _DONE = object()

    def __init__(self, jobs: int, stats: ListStats, work: Callable[[Any, _Crawl], None],
                 close: Callable[[], None] | None = None) -> None:
        self.jobs = jobs
        self.stats = stats
        self._work = work
        self._close = close
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out: queue.Queue[Any] = queue.Queue(maxsize=4 * jobs)
        self._lock = threading.Lock()
        self.pending = 0  # tasks added and not finished; the listing is over when it drops to 0
        self.stopped = threading.Event()

    def add(self, task: Any) -> None:
        if not self.stopped.is_set():
            with self._lock:
                self.pending += 1
            self._tasks.put(task)

    def emit(self, batch: list[Listed]) -> None:
        self._put(batch)

    def count(self, requests: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.stats.requests += requests
            self.stats.retries += retries

    def _put(self, item: Any) -> None:
        while not self.stopped.is_set():
            try:
                self._out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _worker(self) -> None:
        while (task := self._tasks.get()) is not None and not self.stopped.is_set():
            try:
                self._work(task, self)
            except BaseException as exc:  # handed to the consumer's thread, which raises it
                self._put(exc)
            finally:
                with self._lock:
                    self.pending -= 1
                    done = self.pending == 0
                if done:
                    self._put(self._DONE)

    def run(self, first: Any) -> Iterator[list[Listed]]:
        workers = [threading.Thread(target=self._worker, name=f"lingctl-list-{i}", daemon=True)
                   for i in range(self.jobs)]
        for w in workers:
            w.start()
        try:
            self.add(first)
            while True:
                item = self._out.get()
                if item is self._DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                self.stats.objects += len(item)
                yield item
        finally:
            # Also reached when the consumer stops early: queued tasks are dropped, running ones finish
            # their current request or directory and exit.
            self.stopped.set()
            for _ in workers:
                self._tasks.put(None)
            for w in workers:
                w.join()
            if self._close is not None:
                self._close()
            log.debug("listing done: %d objects, %d requests, %d retries", self.stats.objects,
                      self.stats.requests, self.stats.retries)


# -- local directories ------------------------------------------------------------------------------------


class _LocalLister:
    def __init__(self, url: StoreURL, skip_dirs: frozenset[str]) -> None:
        self.root = str(url.path)
        try:
            st = os.stat(self.root)  # follows a root that is itself a link, as the user meant
        except FileNotFoundError:
            raise NotFoundError(f"directory {self.root} does not exist") from None
        except OSError as exc:
            raise os_error(exc, self.root) from exc
        if not stat.S_ISDIR(st.st_mode):
            kind = "a file" if stat.S_ISREG(st.st_mode) else "neither a file nor a directory"
            raise UsageError(f"{self.root} is {kind}, not a directory", hint="give the directory that holds it")
        self.skip_dirs = skip_dirs
        # Symlinks to files are listed only when they resolve inside the real root: a sync must not copy
        # files from elsewhere on the machine just because a link points there.
        self._real_root = os.path.join(os.path.realpath(self.root), "")

    def scan(self, task: tuple[str, str], crawl: _Crawl) -> None:
        directory, rel = task
        crawl.count(requests=1)
        try:
            it = os.scandir(directory)
        except FileNotFoundError:  # removed while the listing ran
            return
        except OSError as exc:
            raise os_error(exc, directory) from exc
        batch: list[Listed] = []
        with it:
            for entry in it:
                name = entry.name
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if name not in self.skip_dirs:
                            crawl.add((entry.path, f"{rel}{name}/"))
                        continue
                    if TMP_MARKER in name:  # an unfinished atomic write
                        continue
                    if entry.is_symlink():
                        st = self._link_target(entry.path)
                        if st is None:
                            continue
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                    else:  # sockets, FIFOs, devices
                        continue
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise os_error(exc, entry.path) from exc
                if not name.isascii() and not _utf8(name):
                    # A name that is not UTF-8 cannot become an S3 key (or a JSON line) as it is.
                    log.warning("skipping %s: its name is not valid UTF-8", os.fsencode(entry.path))
                    continue
                batch.append(Listed(rel + name, st.st_size, st.st_mtime))
                if len(batch) >= _BATCH:
                    crawl.emit(batch)
                    batch = []
        if batch:
            crawl.emit(batch)

    def _link_target(self, path: str) -> os.stat_result | None:
        """The stat of a symlink's target when it is a file inside the root; None (and a warning) otherwise."""
        target = os.path.realpath(path)
        if os.path.isdir(target):
            # Not followed: a link to a directory can form a loop or pull in a whole foreign tree.
            log.warning("not following symlinked directory %s", path)
            return None
        if not os.path.isfile(target):
            log.warning("skipping broken symlink %s", path)
            return None
        if not target.startswith(self._real_root):
            log.warning("skipping symlink %s: it points outside the source (%s)", path, target)
            return None
        return os.stat(target)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.scandir keeps undecodable bytes as lone surrogates
        return False
    return True


# -- S3 ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Range:
    """One page of a delimiter listing of ``prefix``: the entries in (after, until]."""

    prefix: str  # full key prefix, "" or ending in "/"
    after: str = ""  # list entries > after ("": from the start of prefix)
    until: str | None = None  # entries <= until belong here; None: to the end of prefix
    token: str | None = None  # continuation token of this range's previous page


@dataclass(slots=True)
class _Page:
    keys: list[tuple[str, str, str | None, int]]  # (full key, LastModified, ETag, size), in key order
    prefixes: list[str]  # common prefixes, in order
    truncated: bool
    token: str | None


_LIST_RE = re.compile(r"<ListBucketResult[\s>]")
# Fast path: S3's schema orders Key, LastModified, ETag, ..., Size, and AWS, MinIO, Ceph and rclone keep it.
# A reply whose blocks do not all match falls back to parsing each block on its own.
_CONTENTS_RE = re.compile(r"<Contents>\s*<Key>([^<]*)</Key>\s*<LastModified>([^<]*)</LastModified>\s*"
                          r"<ETag>([^<]*)</ETag>.*?<Size>(\d+)</Size>", re.S)
_BLOCK_RE = re.compile(r"<Contents>(.*?)</Contents>", re.S)
_TAG_RES = {tag: re.compile(rf"<{tag}>([^<]*)</{tag}>") for tag in ("Key", "LastModified", "ETag", "Size")}
_PREFIX_RE = re.compile(r"<CommonPrefixes>\s*<Prefix>([^<]*)</Prefix>")
_TRUNCATED_RE = re.compile(r"<IsTruncated>\s*true\s*</IsTruncated>")
_TOKEN_RE = re.compile(r"<NextContinuationToken>([^<]*)</NextContinuationToken>")
_URL_ENCODED_RE = re.compile(r"<EncodingType>\s*url\s*</EncodingType>")
_CODE_RE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE_RE = re.compile(r"<Message>([^<]*)</Message>")
_FRACTION_RE = re.compile(r"\.(\d+)")


def _timestamp(text: str) -> float:
    """Seconds since the epoch of an S3 timestamp such as 2024-05-01T12:34:56.000Z (about 0.5 us each)."""
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:  # Python 3.10 accepts neither "Z" nor fractions other than 3 or 6 digits
        fixed = _FRACTION_RE.sub(lambda m: "." + m.group(1)[:6].ljust(6, "0"), text.replace("Z", "+00:00"), 1)
        dt = datetime.fromisoformat(fixed)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _parse_page(body: str) -> _Page | None:
    """The entries of a ListObjectsV2 reply, keys decoded; None when the body is not one."""
    if _LIST_RE.search(body) is None:
        return None
    # With encoding-type=url keys come as in a query string (space as '+', as AWS and rclone both send
    # them); a server that ignores the parameter sends them raw, XML-escaped.
    decode = unquote_plus if _URL_ENCODED_RE.search(body) else html.unescape
    rows = _CONTENTS_RE.findall(body)
    if len(rows) != body.count("<Contents>"):
        rows = []
        for block in _BLOCK_RE.findall(body):
            fields = {tag: rx.search(block) for tag, rx in _TAG_RES.items()}
            if fields["Key"] is None or fields["Size"] is None or fields["LastModified"] is None:
                return None
            rows.append((fields["Key"].group(1), fields["LastModified"].group(1),
                         fields["ETag"].group(1) if fields["ETag"] else "", fields["Size"].group(1)))
    keys = [(decode(k), lm, etag.replace("&quot;", "").strip('"') or None, int(size)) for k, lm, etag, size in rows]
    prefixes = [decode(p) for p in _PREFIX_RE.findall(body)]
    token = _TOKEN_RE.search(body)
    return _Page(keys, prefixes, _TRUNCATED_RE.search(body) is not None,
                 html.unescape(token.group(1)) if token else None)


def _common_prefix(a: str, b: str) -> str:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]


def _boundaries(prefix: str, names: list[str], until: str | None, limit: int) -> list[str]:
    """Split points for the rest of a range whose page ``names`` (sorted, full keys) came back truncated.

    With ``lcp`` the page's common prefix and ``last`` its last entry, a boundary is ``last[:q] + c`` for a
    position q from len(lcp) back up to _SPLIT_LEVELS positions (never into ``prefix``) and a character c
    above ``last[q]``: fine ranges just past the page, coarser ones further on, none holding keys already
    seen. All are > last and < until, so the ranges (last, b1], (b1, b2], ..., (bn, until] cover the rest
    exactly once. Their balance is a guess; a range that turns out large splits again. No boundaries means
    "go on with the next page", which is itself split once it comes back truncated.
    """
    first, last = names[0], names[-1]
    p = len(_common_prefix(first, last))
    out: list[str] = []
    for q in range(p, max(len(prefix), p - _SPLIT_LEVELS + 1) - 1, -1):
        if q == p:
            seen = {n[p] for n in names if len(n) > p}
        else:
            seen = {last[q]}
            # Above the split position only numbered (decimal or hex) names are worth coarser boundaries:
            # past "file-0999" come "file-1", "file-2"...; past "cat" there is no telling what comes.
            if not seen <= set(_ALPHABETS[1]):
                break
        seen.discard("/")  # the end of a common prefix, not part of a name
        alphabet = next((a for a in _ALPHABETS if seen <= set(a)), _ALPHABETS[-1])
        floor = last[q] if q < len(last) else ""
        level = [last[:q] + c for c in alphabet if c > floor and (until is None or last[:q] + c < until)]
        if q == p and level:
            # The page covered the characters first[p]..last[p] of the alphabet; if the ones left above
            # hold clearly less than another page at that density, one more request beats tiny ranges.
            low = first[p] if len(first) > p else ""
            covered = sum(1 for c in alphabet if low <= c <= floor) or 1
            if len(names) * len(level) / covered < _PAGE / 2:
                continue
        out += level
    bounds = sorted(out)
    if len(bounds) > limit:  # keep an even spread; dropping a boundary only merges two ranges
        step = len(bounds) / limit
        bounds = [bounds[int(i * step)] for i in range(limit)]
    return bounds


class _S3Lister:
    def __init__(self, url: StoreURL, options: S3Options, jobs: int, skip_dirs: frozenset[str]) -> None:
        options.validate()
        import boto3
        import botocore.exceptions
        import urllib3

        self.bucket = url.bucket
        self.prefix = f"{url.prefix}/" if url.prefix else ""
        self.skip_dirs = skip_dirs
        self.options = options
        self.attempts = max(options.max_attempts, _MIN_ATTEMPTS)
        endpoint = options.resolved_endpoint()
        self.endpoint = endpoint or ""
        try:
            session = boto3.session.Session(profile_name=options.profile)
        except botocore.exceptions.ProfileNotFound:
            raise UsageError(f"AWS profile {options.profile!r} not found",
                             hint="check ~/.aws/config or AWS_PROFILE") from None
        self.credentials = session.get_credentials()
        if self.credentials is None:
            raise translate(botocore.exceptions.NoCredentialsError(), self.bucket, self.endpoint, 1)
        # The same resolution as lingctl.core.storage.s3.make_client, so both reach the same server.
        self.region = options.region or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
        path_style = options.path_style if options.path_style is not None else endpoint is not None
        if endpoint is None:
            suffix = "amazonaws.com.cn" if self.region.startswith("cn-") else "amazonaws.com"
            endpoint = f"https://s3.{self.region}.{suffix}"
        parsed = urlparse(endpoint)
        # Dotted bucket names break TLS wildcard certificates on virtual hosts; botocore falls back to
        # path style for them too.
        if path_style or "." in self.bucket:
            self.base = f"{endpoint}/{quote(self.bucket, safe='')}"
        else:
            self.base = f"{parsed.scheme}://{self.bucket}.{parsed.netloc}{parsed.path or '/'}"
        timeout = urllib3.Timeout(connect=options.connect_timeout, read=options.read_timeout)
        kwargs: dict[str, Any] = {"maxsize": jobs, "timeout": timeout}
        if parsed.scheme == "https":
            from botocore.httpsession import get_cert_path

            kwargs["ca_certs"] = os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)
        import urllib.request

        proxy = urllib.request.getproxies().get(parsed.scheme)
        if proxy and not urllib.request.proxy_bypass(parsed.hostname or ""):
            self.http: Any = urllib3.ProxyManager(proxy, num_pools=2, **kwargs)
        else:
            self.http = urllib3.PoolManager(num_pools=2, **kwargs)
        # Range splitting stops for good when the server ignores start-after, or when parallel requests
        # gain it little: a server that re-reads a whole directory per request (rclone serve s3 does)
        # only does more work when one prefix is listed as many ranges.
        self._split_ok = True
        self._lock = threading.Lock()
        self._inflight = 0
        self._solo_latency: float | None = None  # fastest request seen with no other in flight
        self._gain: float | None = None  # running estimate of concurrency * solo latency / latency
        self._gain_samples = 0
        self._gain_proven = False

    def close(self) -> None:
        self.http.clear()

    # -- one page ---------------------------------------------------------------------------------------
    def page(self, r: _Range, crawl: _Crawl) -> None:
        params = {"list-type": "2", "prefix": r.prefix, "delimiter": "/", "max-keys": str(_PAGE),
                  "encoding-type": "url"}
        if r.token:
            params["continuation-token"] = r.token
        elif r.after:
            params["start-after"] = r.after
        page = self._get(params, f"{self.bucket}/{r.prefix}", crawl)
        if r.after and not r.token and self._split_ok:
            # A prefix may legitimately equal start-after (see below); a key may not.
            if page.keys and page.keys[0][0] <= r.after:
                log.warning("S3 server at %s ignores start-after; listing each prefix serially", self.endpoint)
                self._split_ok = False
        cut = len(self.prefix)
        beyond = False
        batch: list[Listed] = []
        names: list[str] = []
        for key, modified, etag, size in page.keys:
            if r.until is not None and key > r.until:
                beyond = True
                break
            if key <= r.after:
                continue
            names.append(key)
            if not key.endswith("/"):  # zero-byte "directory markers" are not objects
                batch.append(Listed(key[cut:], size, _timestamp(modified), etag))
        for p in page.prefixes:
            if r.until is not None and p > r.until:
                beyond = True
                break
            # A start-after inside a common prefix may roll its remaining keys up into the same prefix
            # again (AWS does); it was handed out by the range that holds it.
            if p <= r.after:
                continue
            names.append(p)
            if p[len(r.prefix):-1] not in self.skip_dirs:
                crawl.add(_Range(p))
        if batch:
            crawl.emit(batch)
        if beyond or not page.truncated:
            return
        if not names:
            if page.token:
                crawl.add(_Range(r.prefix, r.after, r.until, page.token))
            else:
                log.warning("S3 server at %s sent a truncated, empty page for %s/%s without a token; stopping there",
                            self.endpoint or "AWS S3", self.bucket, r.prefix)
            return
        names.sort()
        last = names[-1]
        bounds: list[str] = []
        if self._split_ok and 1 < crawl.jobs and crawl.pending < 2 * crawl.jobs:
            # Few ranges until parallel requests have shown they pay, then up to one per worker.
            bounds = _boundaries(r.prefix, names, r.until, crawl.jobs if self._gain_proven else _FIRST_SPLIT - 1)
        if not bounds:
            crawl.add(_Range(r.prefix, last, r.until, page.token))
            return
        for lo, hi in zip([last, *bounds], [*bounds, r.until]):
            crawl.add(_Range(r.prefix, lo, hi))

    def _observe(self, concurrency: int, latency: float) -> None:
        """Track how much parallel requests gain; turn splitting off when it is under _MIN_GAIN."""
        with self._lock:
            if concurrency == 1:
                self._solo_latency = latency if self._solo_latency is None else min(self._solo_latency, latency)
                return
            if concurrency < 4 or self._solo_latency is None or not self._split_ok:
                return
            gain = concurrency * self._solo_latency / max(latency, 1e-6)
            self._gain = gain if self._gain is None else 0.8 * self._gain + 0.2 * gain
            self._gain_samples += 1
            if self._gain_samples < 8:
                return
            self._gain_proven = self._gain >= _MIN_GAIN
            if not self._gain_proven:
                self._split_ok = False
                log.info("S3 server at %s gains %.1fx from %d parallel requests; listing large prefixes page by "
                         "page", self.endpoint or "AWS S3", self._gain, concurrency)

    # -- one request, with retries ----------------------------------------------------------------------
    def _get(self, params: dict[str, str], what: str, crawl: _Crawl) -> _Page:
        import botocore.exceptions as bx
        import urllib3
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        # Encoded exactly as SigV4 canonicalises it, so the signed query is the one sent.
        query = "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))
        url = f"{self.base}?{query}"
        error: Exception | None = None
        for attempt in range(1, self.attempts + 1):
            if attempt > 1:
                crawl.count(retries=1)
                # Exponential backoff with full jitter, so parallel workers do not retry in step.
                delay = random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2 ** (attempt - 2)))
                if crawl.stopped.wait(delay):
                    break
            request = AWSRequest(method="GET", url=url)
            S3SigV4Auth(self.credentials.get_frozen_credentials(), "s3", self.region).add_auth(request)
            crawl.count(requests=1)
            with self._lock:
                self._inflight += 1
                concurrency = self._inflight
            started = time.monotonic()
            try:
                resp = self.http.request("GET", url, headers=dict(request.headers.items()), retries=False)
            except urllib3.exceptions.HTTPError as exc:
                error = _connection_error(exc, url, bx)
                log.debug("list %s: attempt %d: %s", what, attempt, exc)
                continue
            finally:
                with self._lock:
                    self._inflight -= 1
            body = resp.data.decode("utf-8", errors="replace")
            if resp.status == 200:
                self._observe(concurrency, time.monotonic() - started)
                page = _parse_page(body)
                if page is not None:
                    return page
                error = bx.ClientError({"Error": {"Code": "InternalError", "Message": "unreadable listing"},
                                        "ResponseMetadata": {"HTTPStatusCode": 502}}, "ListObjectsV2")
                continue
            code_m, message_m = _CODE_RE.search(body), _MESSAGE_RE.search(body)
            code = html.unescape(code_m.group(1)) if code_m else str(resp.status)
            message = html.unescape(message_m.group(1)) if message_m else (resp.reason or code)
            error = bx.ClientError({"Error": {"Code": code, "Message": message},
                                    "ResponseMetadata": {"HTTPStatusCode": resp.status}}, "ListObjectsV2")
            if resp.status not in _RETRY_STATUS and code not in _RETRY_CODES:
                break
            log.debug("list %s: attempt %d: HTTP %d %s", what, attempt, resp.status, code)
        assert error is not None
        raise translate(error, what, self.endpoint, self.attempts) from error


def _connection_error(exc: Exception, url: str, bx: Any) -> Exception:
    """The botocore exception that matches a urllib3 one, for ``translate``'s wording."""
    import urllib3.exceptions as ux

    if isinstance(exc, ux.ConnectTimeoutError):
        return bx.ConnectTimeoutError(endpoint_url=url)
    if isinstance(exc, ux.ReadTimeoutError):
        return bx.ReadTimeoutError(endpoint_url=url)
    if isinstance(exc, (ux.ProtocolError, ux.IncompleteRead)):
        return bx.ConnectionClosedError(endpoint_url=url)
    return bx.EndpointConnectionError(endpoint_url=url)
