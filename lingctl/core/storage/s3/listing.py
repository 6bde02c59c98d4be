"""S3 listing: signed ListObjectsV2 GETs, a regex parser, and adaptive splitting of the key space.

botocore's paginator spends most of its time parsing timestamps with dateutil, so this lister sends signed
requests through the store's own client (``signed_http``: lingctl's SigV4 signer on ``http_wire``'s keep-alive
pool), retried by the store's retry policy (``retry.Retrier``), and parses the XML with compiled regexes. One
prefix lists serially page by page, so the key space is split to list in parallel: every common prefix of a
delimiter listing becomes its own task, and a prefix whose first page is truncated (a flat directory of
many keys) is cut into StartAfter ranges that list side by side, each range splitting again when it is
itself large.

``rclone serve s3`` (the test server) honours start-after and encoding-type=url, but builds every reply from
the whole directory (and by default reads every file in it for an MD5 ETag), so a request costs time in
proportion to the directory, not the page. Splitting a flat directory there multiplies the server's work
instead of dividing the wait; the lister measures what parallel requests gain and stops splitting when the
gain is small (see ``_MIN_GAIN``).
"""

from __future__ import annotations

import html
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from operator import itemgetter
from typing import TypeVar
from urllib.parse import unquote_plus

from lingctl.core.errors import LingctlError
from lingctl.core.names import printable
from lingctl.core.storage.crawl import Crawl, Listed, ListStats, OnUnreadable
from lingctl.core.storage.metadata import unquoted_etag
from lingctl.core.storage.retry import Retrier
from lingctl.core.storage.s3.client import repeated_token_error
from lingctl.core.storage.s3.reply import S3HTTPError
from lingctl.core.storage.s3.signed_http import SignedS3Client
from lingctl.core.storage.url import StoreURL

log = logging.getLogger("lingctl.babel.listing")

_PAGE = 1000  # ListObjectsV2 max-keys: S3 and rclone cap it at 1000
# The most a listing page may weigh. A page of 1000 keys of S3's longest (1024 bytes of UTF-8, each byte
# %XX-encoded: 3 KiB) with its dates, ETag, size, storage class and checksum fields (~0.4 KiB) is about
# 3.4 MiB; 8 MiB leaves room for servers that indent their XML or add fields.
_PAGE_BYTES = 8 << 20
# Pages in a row that bring nothing new (no key or prefix past the last one) before the listing of that
# range is given up: AWS may send an empty page with a token now and then, never a long run of them.
_MAX_EMPTY_PAGES = 100
_MIN_ATTEMPTS = 5  # a long listing meets more transient errors than a single request does

# Characters where range boundaries are placed, by the kind of name seen on a page: the smallest class that
# covers the page's characters, so numbered or hashed keys do not spend requests on ranges that hold nothing.
# Boundaries only balance the work; every key outside the class still falls in some range.
_ALPHABETS = (
    "0123456789",
    "0123456789abcdef",
    "-.0123456789_abcdefghijklmnopqrstuvwxyz",
    "-./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz~",
)
# Splitting a range costs extra requests (the tail of each range, ranges that turn out empty): worth it
# only while parallel requests finish at least this many times faster than one after another.
_MIN_GAIN = 2.0
_FIRST_SPLIT = 4  # ranges per split until the gain is measured
_SPLIT_LEVELS = 3  # character positions, counted back from the page's common prefix, that get boundaries


@dataclass(frozen=True, slots=True)
class Range:
    """One page of a delimiter listing of ``prefix``: the entries in (after, until]."""

    prefix: str  # full key prefix, "" or ending in "/"
    after: str = ""  # list entries > after ("": from the start of prefix)
    until: str | None = None  # entries <= until belong here; None: to the end of prefix
    token: str | None = None  # continuation token of this range's previous page
    empty: int = 0  # pages in a row, just before this one, that brought nothing new


@dataclass(slots=True)
class _Page:
    keys: list[tuple[str, str, str | None, int]]  # (full key, LastModified, ETag, size), in key order
    prefixes: list[str]  # common prefixes, in order
    truncated: bool
    token: str | None


_LIST_RE = re.compile(r"<ListBucketResult[\s>]")
# Fast path: S3's schema orders Key, LastModified, ETag, ..., Size, and AWS, MinIO, Ceph and rclone keep it.
# A reply whose blocks do not all match falls back to parsing each block on its own.
_CONTENTS_RE = re.compile(
    r"<Contents>\s*<Key>([^<]*)</Key>\s*<LastModified>([^<]*)</LastModified>\s*"
    r"<ETag>([^<]*)</ETag>.*?<Size>(\d+)</Size>",
    re.S,
)
_BLOCK_RE = re.compile(r"<Contents>(.*?)</Contents>", re.S)
_TAG_RES = {tag: re.compile(rf"<{tag}>([^<]*)</{tag}>") for tag in ("Key", "LastModified", "ETag", "Size")}
_PREFIX_RE = re.compile(r"<CommonPrefixes>\s*<Prefix>([^<]*)</Prefix>")
_TRUNCATED_RE = re.compile(r"<IsTruncated>\s*true\s*</IsTruncated>")
_TOKEN_RE = re.compile(r"<NextContinuationToken>([^<]*)</NextContinuationToken>")
_URL_ENCODED_RE = re.compile(r"<EncodingType>\s*url\s*</EncodingType>")
_FRACTION_RE = re.compile(r"\.(\d+)")
_E = TypeVar("_E")


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
            rows.append(
                (
                    fields["Key"].group(1),
                    fields["LastModified"].group(1),
                    fields["ETag"].group(1) if fields["ETag"] else "",
                    fields["Size"].group(1),
                )
            )
    try:
        keys = [(decode(k), lm, unquoted_etag(etag.replace("&quot;", "")), int(size)) for k, lm, etag, size in rows]
    except ValueError:  # a size that is not a number (or has thousands of digits): not a listing
        return None
    prefixes = [decode(p) for p in _PREFIX_RE.findall(body)]
    token = _TOKEN_RE.search(body)
    return _Page(
        keys, prefixes, _TRUNCATED_RE.search(body) is not None, html.unescape(token.group(1)) if token else None
    )


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


def _in_range(r: Range, entries: list[_E], name: Callable[[_E], str]) -> tuple[list[_E], bool]:
    """The entries of a page that belong to ``r`` (after < name <= until), and whether the page went on past
    ``until``. A start-after inside a common prefix may roll its remaining keys up into the same prefix
    again (AWS does): that prefix was handed out by the range that holds it."""
    taken: list[_E] = []
    for entry in entries:
        n = name(entry)
        if r.until is not None and n > r.until:
            return taken, True
        if n > r.after:
            taken.append(entry)
    return taken, False


class S3Lister:
    """Lists everything below ``url`` (or only below ``within``, a key prefix relative to it) on a crawl.

    Pages are signed ListObjectsV2 GETs sent by ``http`` (the store's ``SignedS3Client``), through a
    ``Retrier`` on the AIMD gate of ``retrier`` (the store's, which its other requests share: a throttled List
    halves the requests in flight as a throttled GET does) with the same errors and at least
    ``_MIN_ATTEMPTS`` attempts, counted into the listing's ``ListStats``. ``endpoint`` is for messages."""

    def __init__(
        self,
        url: StoreURL,
        http: SignedS3Client,
        retrier: Retrier,
        skip_dirs: frozenset[str],
        *,
        within: str = "",
        endpoint: str = "",
    ) -> None:
        self.bucket = url.bucket
        self.prefix = f"{url.prefix}/" if url.prefix else ""
        self.within = self.prefix + within
        self.skip_dirs = skip_dirs
        self.endpoint = endpoint
        self.http = http
        self._store_retrier = retrier
        self._retrier: Retrier | None = None
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

    def walk(
        self, first: Range, jobs: int, stats: ListStats, on_unreadable: OnUnreadable | None
    ) -> Iterator[list[Listed]]:
        """The crawl from ``first``, in batches; its requests are counted into ``stats``."""
        crawl = Crawl(jobs, stats, self.page, on_unreadable=on_unreadable)
        store = self._store_retrier
        self._retrier = Retrier(
            store.gate,
            store.translate,
            attempts=max(store.attempts, _MIN_ATTEMPTS),
            counters=stats,
            stop=crawl.stopped,
        )
        return crawl.run(first)

    # -- one page ---------------------------------------------------------------------------------------
    def page(self, r: Range, crawl: Crawl) -> None:
        page = self._get(r)
        self._check_start_after(r, page)
        rows, rows_beyond = _in_range(r, page.keys, itemgetter(0))
        prefixes, prefixes_beyond = _in_range(r, page.prefixes, str)
        batch = self._objects(rows)
        for p in prefixes:
            if p[len(r.prefix) : -1] not in self.skip_dirs and (p.startswith(self.within) or self.within.startswith(p)):
                crawl.add(Range(p))
        if batch:
            crawl.emit(batch)
        if rows_beyond or prefixes_beyond or not page.truncated:
            return
        names = sorted([row[0] for row in rows] + prefixes)
        if names:
            self._go_on(r, names, page.token, crawl)
        else:
            self._skip_empty(r, page.token, crawl)

    def _objects(self, rows: list[tuple[str, str, str | None, int]]) -> list[Listed]:
        """The objects among a page's keys, relative to the root; "directory markers" are not objects."""
        cut = len(self.prefix)
        return [
            Listed(key[cut:], size, self._mtime(key, modified), etag)
            for key, modified, etag, size in rows
            if not key.endswith("/") and key.startswith(self.within)
        ]

    def _mtime(self, key: str, modified: str) -> float:
        try:
            return _timestamp(modified)
        except ValueError:
            raise LingctlError(
                f"S3 endpoint {self.endpoint or 'AWS S3'} lists {printable(f'{self.bucket}/{key}')} with "
                f"a LastModified that is not a date: {printable(modified[:40])!r}",
                hint="the server is broken, or something on the way to it rewrites its answers",
            ) from None

    def _check_start_after(self, r: Range, page: _Page) -> None:
        # A prefix may legitimately equal start-after (``_in_range``); a key may not.
        if r.after and not r.token and self._split_ok and page.keys and page.keys[0][0] <= r.after:
            log.warning("S3 server at %s ignores start-after; listing each prefix serially", self.endpoint or "AWS S3")
            self._split_ok = False

    def _skip_empty(self, r: Range, token: str | None, crawl: Crawl) -> None:
        """A truncated page that brought nothing new: follow its token, unless it goes round in circles."""
        if not token:
            log.warning(
                "S3 server at %s sent a truncated, empty page for %s/%s without a token; stopping there",
                self.endpoint or "AWS S3",
                self.bucket,
                printable(r.prefix),
            )
            return
        # A token handed back again (or pages that never move on) would make this range list for ever:
        # 4,000 identical requests in minutes, and no end.
        if token == r.token or r.empty >= _MAX_EMPTY_PAGES:
            raise repeated_token_error(self.endpoint, f"{self.bucket}/{r.prefix}")
        crawl.add(Range(r.prefix, r.after, r.until, token, r.empty + 1))

    def _go_on(self, r: Range, names: list[str], token: str | None, crawl: Crawl) -> None:
        """The rest of a truncated range past its page's last name: the next page, or split into ranges."""
        last = names[-1]
        bounds: list[str] = []
        if self._split_ok and 1 < crawl.jobs and crawl.pending < 2 * crawl.jobs:
            # Few ranges until parallel requests have shown they pay, then up to one per worker.
            bounds = _boundaries(r.prefix, names, r.until, crawl.jobs if self._gain_proven else _FIRST_SPLIT - 1)
        if not bounds:
            crawl.add(Range(r.prefix, last, r.until, token))
            return
        for lo, hi in zip([last, *bounds], [*bounds, r.until]):
            crawl.add(Range(r.prefix, lo, hi))

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
                log.info(
                    "S3 server at %s gains %.1fx from %d parallel requests; listing large prefixes page by page",
                    self.endpoint or "AWS S3",
                    self._gain,
                    concurrency,
                )

    # -- one request, with retries ----------------------------------------------------------------------
    def _get(self, r: Range) -> _Page:
        params = {
            "list-type": "2",
            "prefix": r.prefix,
            "delimiter": "/",
            "max-keys": str(_PAGE),
            "encoding-type": "url",
        }
        if r.token:
            params["continuation-token"] = r.token
        elif r.after:
            params["start-after"] = r.after
        assert self._retrier is not None, "pages are listed by walk()'s crawl"
        return self._retrier.call(printable(f"{self.bucket}/{r.prefix}"), self._fetch, params)

    def _fetch(self, params: dict[str, str]) -> _Page:
        """One request for a page; an answer that is not a listing is a server error (502), sent again."""
        with self._lock:
            self._inflight += 1
            concurrency = self._inflight
        started = time.monotonic()
        try:
            body = self.http.list_objects(params, limit=_PAGE_BYTES)
        finally:
            with self._lock:
                self._inflight -= 1
        self._observe(concurrency, time.monotonic() - started)
        page = _parse_page(body)
        if page is None:
            raise S3HTTPError(
                status=502,
                code="InternalError",
                message="unreadable listing",
                operation="ListObjectsV2",
                key=params["prefix"],
            )
        return page
