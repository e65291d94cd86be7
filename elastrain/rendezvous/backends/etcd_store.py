"""A torch.distributed ``Store`` on etcd v3: what the agents share besides the rendezvous state.

torch's agent uses the rendezvous store for rank assignment (``set``, ``multi_get``, ``multi_set``,
blocking ``get``), for barriers (``add``, ``wait``) and to publish MASTER_ADDR/MASTER_PORT; the dynamic
rendezvous wraps it in a ``PrefixStore`` per round. Keys live under ``<root>/store/`` and share the job's
lease. Blocking reads poll with a short, growing interval (10 ms to 100 ms) until the store's timeout;
a timeout raises ``DistStoreError`` like torch's own stores.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import Store
from torch.distributed import DistStoreError

from elastrain.rendezvous.backends.etcd_client import EtcdClient

_POLL_START_S = 0.01
_POLL_MAX_S = 0.1


def _bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(Store):
    """c10d Store semantics on etcd keys; safe to use from several agents (and threads) at once."""

    def __init__(self, client: EtcdClient, prefix: str = "store/", timeout: timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._client = client
        self._prefix = client.root + prefix
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _deadline(self, timeout: timedelta | None) -> tuple[float, float]:
        current: timedelta = self.timeout  # type: ignore[attr-defined]  # set by c10d's Store base
        seconds = (timeout if timeout is not None else current).total_seconds()
        return time.monotonic() + seconds, seconds

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), _bytes(value))

    def _wait_values(self, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        deadline, seconds = self._deadline(timeout)
        delay = _POLL_START_S
        full = [self._key(k) for k in keys]
        while True:
            values = self._client.get_many(full)
            if all(v is not None for v in values):
                return [v for v in values if v is not None]
            now = time.monotonic()
            if now >= deadline:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise DistStoreError(
                    f"Timeout after {seconds:g} s waiting for etcd store key(s) {missing} under {self._prefix}"
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 1.5, _POLL_MAX_S)

    def get(self, key: str) -> bytes:
        return self._wait_values([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_values(keys, None)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values")
        self._client.put_many([(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_values(keys, timeout)

    def count_prefix(self, prefix: str) -> int:
        """How many keys start with ``prefix`` (one request, however many there are)."""
        return self._client.count_prefix(self._key(prefix))

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._client.get_many([self._key(k) for k in keys]))

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer at ``key`` (0 if absent); return the new value."""
        full = self._key(key)
        while True:
            found = self._client.get(full)
            try:
                new = value if found is None else int(found[0]) + value
            except ValueError:  # as c10d's stores: a typed store error, not a crash
                raise DistStoreError(f"the etcd store key {key} holds a value that is no integer") from None
            revision = None if found is None else found[1]

            def compare(t: Any, revision: int | None = revision) -> list[Any]:
                return [t.create(full) == 0] if revision is None else [t.mod(full) == revision]

            def success(t: Any, lease: int, new: int = new) -> list[Any]:
                return [t.put(full, str(new), lease=lease)]

            ok, _ = self._client.transaction("store add", compare, success, lambda t: [])
            if ok:
                return new

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """c10d semantics: set if the value is ``expected`` (or absent and ``expected`` empty); return the value."""
        full = self._key(key)
        expected, desired = _bytes(expected_value), _bytes(desired_value)

        def compare(t: Any) -> list[Any]:
            return [t.create(full) == 0] if not expected else [t.value(full) == expected]

        ok, responses = self._client.transaction(
            "store compare_set", compare, lambda t, lease: [t.put(full, desired, lease=lease)], lambda t: [t.get(full)]
        )
        if ok:
            return desired
        found = responses[0]
        return bytes(found[0][0]) if found else expected

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        return self._client.count_prefix(self._prefix)
