"""Bounded HTTP requests to an instance metadata endpoint.

Every request has a timeout, never goes through a proxy (metadata addresses are link-local), and turns
every transport failure into :class:`PreemptionWatcherError`. HTTP error statuses are returned, not
raised: AWS answers 404 when there is no notice.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastrain.errors import PreemptionWatcherError

# Every cloud serves its instance metadata at this link-local address (GCP's metadata.google.internal too).
DEFAULT_METADATA_ENDPOINT = "http://169.254.169.254"
_MAX_BODY = 1 << 20

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Response:
    status: int
    body: str
    headers: Mapping[str, str] = field(default_factory=dict)


def base_url(endpoint: str | None) -> str:
    """``http://host[:port]`` without a trailing slash; a bare ``host:port`` gets ``http://``."""
    url = (endpoint or DEFAULT_METADATA_ENDPOINT).strip().rstrip("/")
    return url if "://" in url else "http://" + url


def request(
    url: str,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float = 1.0,
) -> Response:
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with _opener.open(req, timeout=timeout_s) as resp:
            data = resp.read(_MAX_BODY)
            return Response(
                resp.status, data.decode("utf-8", "replace"), {k.lower(): v for k, v in resp.headers.items()}
            )
    except urllib.error.HTTPError as exc:
        try:
            data = exc.read(_MAX_BODY)
        except OSError:
            data = b""
        hdrs = {k.lower(): v for k, v in exc.headers.items()} if exc.headers else {}
        return Response(exc.code, data.decode("utf-8", "replace"), hdrs)
    except TimeoutError as exc:
        raise PreemptionWatcherError(f"{method} {url}: no answer within {timeout_s:g} s") from exc
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise PreemptionWatcherError(f"{method} {url}: no answer within {timeout_s:g} s") from exc
        raise PreemptionWatcherError(f"{method} {url}: {reason}") from exc
