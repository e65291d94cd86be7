"""Options of the etcd-v3 rendezvous: ``--rdzv-endpoint`` and the etcd keys of ``--rdzv-conf``, validated.

Bad values raise :class:`~elastrain.errors.UsageError` naming the flag and the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain.binding import is_loopback
from elastrain.errors import UsageError

DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/elastrain"


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd, from ``--rdzv-endpoint`` and ``--rdzv-conf``."""

    endpoints: tuple[tuple[str, int], ...]
    key_prefix: str = DEFAULT_KEY_PREFIX
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    user: str | None = None
    password: str | None = None
    connect_timeout_s: float = 10.0
    """How long the first contact may take before the launch fails."""
    request_timeout_s: float = 5.0
    """Deadline of one etcd request."""
    retry_timeout_s: float = 60.0
    """How long a request is retried through an etcd outage before the agent gives up."""
    lease_ttl_s: int = 60
    """Seconds the job's keys outlive the last agent."""
    compact_interval_s: float = 300.0
    """Every this many seconds, compact etcd's history up to the previous pass (0: leave it to etcd)."""
    allow_insecure_password: bool = False
    """Send the password to a non-loopback etcd without TLS (in clear text) anyway."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise UsageError("--rdzv-endpoint", "etcd-v3 needs at least one host:port")
        if not self.key_prefix.startswith("/"):
            raise UsageError("--rdzv-conf", f"key_prefix must start with '/', got {self.key_prefix!r}")
        if (self.client_cert is None) != (self.client_key is None):
            raise UsageError("--rdzv-conf", "client_cert and client_key must be given together")
        if self.client_cert is not None and self.ca_cert is None:
            raise UsageError("--rdzv-conf", "client_cert needs ca_cert (the CA that signed etcd's certificate)")
        if (self.user is None) != (self.password is None):
            raise UsageError("--rdzv-conf", "user and password (or password_file) must be given together")
        remote = [f"{h}:{p}" for h, p in self.endpoints if not is_loopback(h)]
        if self.password is not None and not self.secure and remote and not self.allow_insecure_password:
            # Refused rather than warned: the password (and etcd's token for it) would cross the network in clear
            # text on every connection, and a warning scrolls by; the opt-out is one explicit key.
            raise UsageError(
                "--rdzv-conf password",
                f"etcd at {','.join(remote)} without TLS would receive the password in clear text; give "
                "ca_cert=PATH (TLS), or allow_insecure_password=true to send it anyway",
            )
        for name in ("ca_cert", "client_cert", "client_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise UsageError("--rdzv-conf", f"{name}={path} is not a readable file")
        for name in ("connect_timeout_s", "request_timeout_s", "retry_timeout_s"):
            if getattr(self, name) <= 0:
                raise UsageError("--rdzv-conf", f"{name.removesuffix('_s')} must be > 0 seconds")
        if self.compact_interval_s < 0:
            raise UsageError("--rdzv-conf", f"compact_interval must be >= 0 seconds, got {self.compact_interval_s}")
        if self.lease_ttl_s < 5:
            raise UsageError("--rdzv-conf", f"lease_ttl must be at least 5 seconds, got {self.lease_ttl_s}")

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None

    def describe(self) -> str:
        scheme = "https" if self.secure else "http"
        return ",".join(f"{scheme}://{host}:{port}" for host, port in self.endpoints)


def parse_endpoints(text: str | None) -> tuple[tuple[str, int], ...]:
    """``host[:port][,host[:port]...]``, optionally with ``http://``/``https://``; port 2379 by default."""
    out = []
    for raw in (text or "").split(","):
        item = raw.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            item = item.removeprefix(scheme)
        item = item.rstrip("/")
        host, sep, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        host = host.strip("[]")
        try:
            port_no = int(port)
        except ValueError:
            raise UsageError("--rdzv-endpoint", f"expected host:port, got {raw.strip()!r}") from None
        if not host or not 0 < port_no < 65536:
            raise UsageError("--rdzv-endpoint", f"expected host:port, got {raw.strip()!r}")
        out.append((host, port_no))
    return tuple(out)


def store_address(text: str | None) -> str:
    """The job's etcd as one string, the same on every node however its ``--rdzv-endpoint`` spells the cluster
    (another order, a scheme, the default port left out): fencing claims name their world's store by it, and a
    node compares it with its own (before, ``a,b`` and ``b,a`` were two stores, and a node superseded on its own etcd
    left instead of joining the newer world there)."""
    return ",".join(sorted({f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in parse_endpoints(text)}))


def _conf(params: RendezvousParameters, *names: str) -> str | None:
    for name in names:
        value = params.get(name)
        if value is not None and str(value) != "":
            return str(value)
    return None


def _float(params: RendezvousParameters, name: str, default: float) -> float:
    raw = _conf(params, name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise UsageError("--rdzv-conf", f"{name} must be a number of seconds, got {raw!r}") from None


def _bool(params: RendezvousParameters, name: str) -> bool:
    raw = _conf(params, name)
    if raw is None:
        return False
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise UsageError("--rdzv-conf", f"{name} must be true or false, got {raw!r}")


def options_from_params(params: RendezvousParameters) -> EtcdOptions:
    """Read ``--rdzv-endpoint`` and the etcd keys of ``--rdzv-conf`` (torch's etcd names accepted too)."""
    password = _conf(params, "password")
    password_file = _conf(params, "password_file")
    if password_file is not None:
        try:
            password = Path(password_file).read_text().strip()
        except OSError as exc:
            raise UsageError("--rdzv-conf", f"password_file={password_file} cannot be read: {exc}") from None
    return EtcdOptions(
        endpoints=parse_endpoints(params.endpoint),
        key_prefix=(_conf(params, "key_prefix", "etcd_prefix") or DEFAULT_KEY_PREFIX).rstrip("/") or "/",
        ca_cert=_conf(params, "ca_cert", "cacert"),
        client_cert=_conf(params, "client_cert", "cert"),
        client_key=_conf(params, "client_key", "key"),
        user=_conf(params, "user", "username"),
        password=password,
        connect_timeout_s=_float(params, "connect_timeout", 10.0),
        request_timeout_s=_float(params, "request_timeout", 5.0),
        retry_timeout_s=_float(params, "retry_timeout", 60.0),
        lease_ttl_s=int(_float(params, "lease_ttl", 60)),
        compact_interval_s=_float(params, "compact_interval", 300.0),
        allow_insecure_password=_bool(params, "allow_insecure_password"),
    )
