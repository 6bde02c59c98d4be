"""AWS Signature Version 4 for the S3 requests lingctl sends itself, and where their credentials come from.

botocore's signer needs ``botocore.auth`` and ``botocore.awsrequest``, about 0.2 s of imports: more than a
no-op re-sync of a few thousand files takes in all. Signing is a few HMACs, so it is done here (per AWS's
SigV4 specification, as botocore's ``S3SigV4Auth`` does it: the path exactly as sent, the query pairs as
sent in sorted order, every header but ``User-Agent``/``Expect`` signed, ``x-amz-content-sha256`` always).

Credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (+ ``AWS_SESSION_TOKEN``) from the environment
when no profile is asked for, which is also the first place botocore looks; anything else (profiles, SSO,
instance roles, credential processes) goes through botocore's own provider chain, imported only then.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lingctl.core.storage.url import add_secret

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNSIGNED_HEADERS = frozenset({"user-agent", "expect", "transfer-encoding", "x-amzn-trace-id"})


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key: str
    secret_key: str
    token: str | None = None


class CredentialSource:
    """The current credentials: fixed ones from the environment, or botocore's (which may refresh)."""

    def __init__(self, fixed: Credentials | None = None, botocore_credentials: Any = None) -> None:
        self._fixed = fixed
        self._botocore = botocore_credentials

    def get(self) -> Credentials:
        if self._fixed is not None:
            return self._fixed
        frozen = self._botocore.get_frozen_credentials()
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)


def resolve(profile: str | None, region: str | None) -> tuple[CredentialSource | None, str]:
    """Credentials (None when there are none) and the region, resolved as botocore resolves them."""
    env = os.environ
    if not profile and not env.get("AWS_PROFILE"):
        key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        resolved_region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        if key and secret and resolved_region:
            return CredentialSource(Credentials(key, secret, env.get("AWS_SESSION_TOKEN") or None)), resolved_region
    import botocore.session

    session = botocore.session.Session(profile=profile)  # ProfileNotFound is the caller's to translate
    resolved_region = region or env.get("AWS_REGION") or session.get_config_variable("region") or "us-east-1"
    creds = session.get_credentials()
    return (CredentialSource(botocore_credentials=creds) if creds is not None else None), resolved_region


class Signer:
    """Signs S3 requests for one region; thread-safe (the signing key is cached per day)."""

    def __init__(
        self,
        credentials: CredentialSource,
        region: str,
        service: str = "s3",
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.credentials = credentials
        self.region = region
        self.service = service
        self._clock = clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self._lock = threading.Lock()
        self._key: tuple[str, str, bytes] | None = None  # (secret, date, signing key)
        self._token: str | None = None

    def _signing_key(self, secret: str, date: str) -> bytes:
        with self._lock:
            if self._key is not None and self._key[0] == secret and self._key[1] == date:
                return self._key[2]
        add_secret(secret)  # once per secret and day: no error message may ever quote it
        key = _hmac(("AWS4" + secret).encode(), date)
        for part in (self.region, self.service, "aws4_request"):
            key = _hmac(key, part)
        with self._lock:
            self._key = (secret, date, key)
        return key

    def sign(self, method: str, path: str, query: str, headers: dict[str, str], payload_hash: str) -> dict[str, str]:
        """``headers`` plus ``x-amz-date``, ``x-amz-content-sha256``, the session token and
        ``Authorization``. ``path`` and ``query`` exactly as they will be sent (already percent-encoded);
        ``headers`` must hold ``Host``."""
        creds = self.credentials.get()
        now = self._clock()
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        date = amz_date[:8]
        out = {
            k: v
            for k, v in headers.items()
            if k.lower() not in ("authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token")
        }
        out["x-amz-date"] = amz_date
        out["x-amz-content-sha256"] = payload_hash
        if creds.token:
            if creds.token is not self._token:  # a new token (refreshed credentials): never to be shown
                add_secret(creds.token)
                self._token = creds.token
            out["x-amz-security-token"] = creds.token
        signed = sorted(
            (k.lower(), " ".join(str(v).split())) for k, v in out.items() if k.lower() not in _UNSIGNED_HEADERS
        )
        signed_names = ";".join(name for name, _ in signed)
        canonical = "\n".join(
            [
                method,
                path or "/",
                _canonical_query(query),
                "".join(f"{name}:{value}\n" for name, value in signed),
                signed_names,
                payload_hash,
            ]
        )
        scope = f"{date}/{self.region}/{self.service}/aws4_request"
        to_sign = "\n".join([ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._signing_key(creds.secret_key, date), to_sign.encode(), hashlib.sha256).hexdigest()
        out["Authorization"] = (
            f"{ALGORITHM} Credential={creds.access_key}/{scope}, SignedHeaders={signed_names}, Signature={signature}"
        )
        return out


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _canonical_query(query: str) -> str:
    """The query's ``name=value`` pairs as sent (already encoded), sorted; a bare name gets ``=``."""
    if not query:
        return ""
    pairs = []
    for item in query.split("&"):
        name, _, value = item.partition("=")
        pairs.append((name, value))
    return "&".join(f"{name}={value}" for name, value in sorted(pairs))
