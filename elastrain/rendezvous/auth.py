"""The job's shared rendezvous secret: what it signs, and how a node checks what it reads.

Without a secret, whoever reaches the rendezvous store (the c10d TCPStore has no access control; an etcd without
auth neither) can write the state every node acts on. With one (``--rdzv-conf secret_file=PATH``, or the file
named by ``ELASTRAIN_RDZV_SECRET_FILE``; never the value itself on a command line), every value a node writes is
*sealed*: an HMAC-SHA256 over the value and its place (the run id and the key's name, so that a sealed value
cannot be moved to another key or job), in an envelope::

    elastrain-sealed/1 <key id: 16 hex> <mac: 64 hex>\\n<value>

A node opens what it reads: a value without a valid seal is *forged* (:class:`RendezvousForgeryError`) and never
acted on (the handler keeps its last good state and writes it back: :mod:`elastrain.rendezvous.trust`). A node
without the secret that reads a sealed state is refused with one line naming the setting
(:class:`RendezvousSecretError`); the key id (a hash of the secret) tells a node with another secret apart from
a forgery. Seals authenticate; they do not hide: anyone who reaches the store can still read it.

Counters that the store adds to (the state's version, re-join counts, torch's barrier counts) stay plain numbers:
they are hints that make nodes read again, never acted on by themselves.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from torch._C._distributed_c10d import Store
from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain import env
from elastrain.errors import RendezvousForgeryError, RendezvousSecretError, UsageError
from elastrain.log import lifecycle

MAGIC = b"elastrain-sealed/1 "
_KEY_ID_HEX = 16
_MAC_HEX = 64
_HEADER = len(MAGIC) + _KEY_ID_HEX + 1 + _MAC_HEX + 1
MIN_SECRET_BYTES = 16
SECRET_SETTING = f"--rdzv-conf secret_file (or {env.RDZV_SECRET_FILE})"


def is_sealed(data: bytes) -> bool:
    return data.startswith(MAGIC)


def _key_id(secret: bytes) -> str:
    """Tells secrets apart without revealing them (a MAC does as much: either lets a weak secret be guessed)."""
    return hashlib.sha256(b"elastrain rendezvous key id\0" + secret).hexdigest()[:_KEY_ID_HEX]


# torch's stub types Store values as str; every Store takes bytes (torch's own agent writes bytes).
def set_bytes(store: Store, key: str, value: bytes) -> None:
    store.set(key, value)  # type: ignore[arg-type]


def _multi_set_bytes(store: Store, keys: list[str], values: list[bytes]) -> None:
    store.multi_set(keys, values)  # type: ignore[attr-defined]


def compare_set_bytes(store: Store, key: str, expected: bytes, desired: bytes) -> bytes:
    return bytes(store.compare_set(key, expected, desired))  # type: ignore[arg-type]


def read_secret(path: str, setting: str) -> bytes:
    """The secret in the file at ``path`` (surrounding whitespace dropped); UsageError naming ``setting``."""
    try:
        secret = Path(path).read_bytes().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UsageError(setting, f"the secret file {path} cannot be read ({exc.strerror or exc})") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise UsageError(
            setting,
            f"the secret in {path} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random ones "
            "(for example: openssl rand -hex 32 > FILE)",
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        lifecycle("secret_file_shared", level=logging.WARNING, path=path, why="group or others may read it: chmod 600")
    return secret


def secret_from(params: RendezvousParameters) -> bytes | None:
    """The job's secret: ``--rdzv-conf secret_file``, else ``ELASTRAIN_RDZV_SECRET_FILE``; None when neither is set."""
    if params.get("secret", None) is not None:
        raise UsageError(
            "--rdzv-conf secret",
            f"a secret on the command line is visible to every user of the machine; put it in a file and give "
            f"secret_file=PATH, or set {env.RDZV_SECRET_FILE}=PATH",
        )
    path = params.get("secret_file", None)
    if path:
        return read_secret(str(path), "--rdzv-conf secret_file")
    path = os.environ.get(env.RDZV_SECRET_FILE, "")
    if path:
        return read_secret(path, env.RDZV_SECRET_FILE)
    return None


class RendezvousAuth:
    """Seals and opens one job's rendezvous values with its secret; without one, refuses sealed states."""

    def __init__(self, secret: bytes | None, run_id: str) -> None:
        self._secret = secret
        self._run = run_id.encode()
        self.key_id = _key_id(secret) if secret else ""

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RendezvousAuth:
        return cls(secret_from(params), str(params.run_id))

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _mac(self, context: bytes, value: bytes) -> str:
        if self._secret is None:
            return ""
        msg = context + b"\0" + self._run + b"\0" + value
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def _seal(self, context: bytes, value: bytes) -> bytes:
        if self._secret is None:
            return value
        return MAGIC + f"{self.key_id} {self._mac(context, value)}\n".encode() + value

    def _open(self, context: bytes, data: bytes, what: str) -> bytes:
        if self._secret is None:
            return data
        if not is_sealed(data) or len(data) < _HEADER or data[_HEADER - 1 : _HEADER] != b"\n":
            raise RendezvousForgeryError(f"{what} is not signed with the job's secret ({len(data)} bytes)")
        key_id = data[len(MAGIC) : len(MAGIC) + _KEY_ID_HEX].decode(errors="replace")
        mac = data[len(MAGIC) + _KEY_ID_HEX + 1 : _HEADER - 1].decode(errors="replace")
        value = data[_HEADER:]
        if key_id != self.key_id:
            raise RendezvousForgeryError(f"{what} is signed with another secret (key id {key_id!r})", foreign=True)
        if not hmac.compare_digest(mac, self._mac(context, value)):
            raise RendezvousForgeryError(f"{what} carries a signature that does not match its content")
        return value

    # -- the state ------------------------------------------------------------------------------------
    def seal_state(self, payload: bytes) -> bytes:
        return self._seal(b"state", payload)

    def open_state(self, data: bytes) -> bytes:
        """The state's payload; raises :class:`RendezvousForgeryError` (forged) or :class:`RendezvousSecretError`
        (sealed, and this node has no secret)."""
        if self._secret is None and is_sealed(data):
            raise RendezvousSecretError(
                SECRET_SETTING,
                f"the rendezvous of run {self._run.decode()!r} is signed with a shared secret that this node was "
                "not given; start it with the job's secret file",
            )
        return self._open(b"state", data, "the rendezvous state")

    # -- keys beside the state (heartbeats, re-joins, the judge's snapshot) --------------------------------
    def seal(self, key: str, value: str | bytes) -> bytes:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return self._seal(b"key\0" + key.encode(), raw)

    def open(self, key: str, data: bytes) -> bytes:
        return self._open(b"key\0" + key.encode(), bytes(data), f"the rendezvous key {key}")

    # -- fencing claims: the store a claim publishes -------------------------------------------------------
    def store_mac(self, store: str) -> str:
        """The signature of a fencing claim's store address ("" without a secret)."""
        return self._mac(b"claim-store", store.encode())

    def signed_store(self, store: str, mac: str) -> bool:
        """Whether ``mac`` signs ``store`` for this job (never without a secret)."""
        return self.enabled and bool(mac) and hmac.compare_digest(mac, self.store_mac(store))

    # -- the end of the job, recorded beside the fencing claims --------------------------------------------
    def close_mac(self, generation: int) -> str:
        """The signature of the close of the job's world ``generation`` ("" without a secret)."""
        return self._mac(b"job-closed", str(generation).encode())

    def signed_close(self, generation: int, mac: str) -> bool:
        """Whether ``mac`` signs the close of ``generation`` for this job (never without a secret)."""
        return self.enabled and bool(mac) and hmac.compare_digest(mac, self.close_mac(generation))

    def vacate_mac(self, generation: int) -> str:
        """The signature of the mark that the job's world ``generation`` was left by its last node ("" without a
        secret; apart from a close's, so that one never stands for the other)."""
        return self._mac(b"world-vacated", str(generation).encode())

    def signed_vacate(self, generation: int, mac: str) -> bool:
        """Whether ``mac`` signs the vacating of ``generation`` for this job (never without a secret)."""
        return self.enabled and bool(mac) and hmac.compare_digest(mac, self.vacate_mac(generation))


class _Throttle:
    """One log line per interval for forged values read through a :class:`SignedStore`."""

    def __init__(self, every_s: float = 10.0) -> None:
        self._every = every_s
        self._last = -1e18
        self._hidden = 0

    def log(self, key: str, exc: RendezvousForgeryError) -> None:
        now = time.monotonic()
        if now - self._last < self._every:
            self._hidden += 1
            return
        self._last, hidden, self._hidden = now, self._hidden, 0
        lifecycle("rendezvous_value_ignored", level=logging.WARNING, key=key, error=str(exc), not_logged_since=hidden)


class SignedStore(Store):
    """A round's store as torch's agent sees it (rank assignment, barriers), with every value sealed.

    ``get`` of a forged value raises ``DistStoreError``: the agent forms the next round, as when a member's value
    never came (a forged key never becomes a rank or an address). ``add`` counters pass unsealed.
    """

    def __init__(self, inner: Store, auth: RendezvousAuth, scope: str) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._inner = inner
        self._auth = auth
        self._scope = scope
        self._throttle = _Throttle()

    def _name(self, key: str) -> str:
        return self._scope + key

    def _opened(self, key: str, data: bytes) -> bytes:
        try:
            return self._auth.open(self._name(key), data)
        except RendezvousForgeryError as exc:
            self._throttle.log(self._name(key), exc)
            raise DistStoreError(f"the rendezvous key {self._name(key)} is not signed with the job's secret") from exc

    @property
    def timeout(self) -> timedelta:
        current: timedelta = self._inner.timeout  # type: ignore[attr-defined]
        return current

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        set_bytes(self._inner, key, self._auth.seal(self._name(key), value))

    def get(self, key: str) -> bytes:
        return self._opened(key, bytes(self._inner.get(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._opened(k, bytes(v)) for k, v in zip(keys, self._inner.multi_get(keys), strict=True)]

    def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None:
        _multi_set_bytes(
            self._inner, keys, [self._auth.seal(self._name(k), v) for k, v in zip(keys, values, strict=True)]
        )

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        expected = self._auth.seal(self._name(key), expected_value) if expected_value else b""
        got = compare_set_bytes(self._inner, key, expected, self._auth.seal(self._name(key), desired_value))
        return self._opened(key, got) if got else got

    def add(self, key: str, value: int) -> int:
        return int(self._inner.add(key, value))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())
