"""Which ``--rdzv-conf`` keys mean something, and what a key that means nothing gets: a typo is refused.

torch's handlers ignore a key they do not read, so ``heartbeat_timout=10`` would run the job with the default
timeout, silently. For elastrain's own rendezvous (c10d, etcd-v3) every key is checked at start against the keys it
reads and those torch's handlers read (a torchrun command line stays valid as it is): a key within a typo of one of
them is refused with one line that names it and the key it looks like; any other unknown key is reported once and
ignored (it may be meant for something else that reads the same configuration).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from elastrain.errors import UsageError

ELASTRAIN = frozenset(
    {
        # the handler's settings (elastrain.rendezvous.settings)
        "heartbeat_interval", "heartbeat_timeout", "last_call_timeout", "join_timeout", "store_lost_timeout",
        "scale_up_window", "store_op_timeout", "claim_grace", "refound_after",
        # the job's secret (elastrain.rendezvous.auth), the agents' store (c10d or etcd), the fencing root
        "secret", "secret_file", "read_timeout", "is_host", "checkpoint_root",
        # etcd (elastrain.rendezvous.backends.etcd_options), with torch's etcd names
        "key_prefix", "etcd_prefix", "ca_cert", "cacert", "client_cert", "cert", "client_key", "key", "user",
        "username", "password", "password_file", "connect_timeout", "request_timeout", "retry_timeout", "lease_ttl",
        "compact_interval", "allow_insecure_password",
    }
)  # fmt: skip
"""The keys elastrain's rendezvous reads."""

TORCH = frozenset(
    {
        "timeout", "close_timeout", "join_timeout", "last_call_timeout", "heartbeat_timeout", "read_timeout",
        "is_host", "keep_alive_interval", "keep_alive_max_attempt", "protocol", "ssl_cert", "ssl_cert_key",
        "store_type", "rank", "use_libuv", "local_addr",
    }
)  # fmt: skip
"""Keys torch's rendezvous handlers and launcher read (accepted as they are: a torchrun command line stays valid)."""

KNOWN = ELASTRAIN | TORCH


def unknown_keys(conf: Mapping[str, str] | Iterable[str]) -> list[str]:
    """Pure: the keys of ``conf`` that no handler reads, in order. Raises :class:`UsageError` for the first one that
    is a likely typo of a key elastrain reads (naming both)."""
    out = []
    for key in conf:
        if key in KNOWN:
            continue
        near = difflib.get_close_matches(key, sorted(ELASTRAIN), n=1, cutoff=0.8)
        if near:
            raise UsageError(f"--rdzv-conf {key}", f"no such key; did you mean {near[0]}?")
        out.append(key)
    return out
