"""A world's generation in its checkpoint root, as the commit protocol (:mod:`elastrain.checkpoint.commit`) fences it.

Step 0 of the protocol, and the fence checks of steps 1 and 3: where the workers fence the root themselves
(:func:`elastrain.fence.worker_world`), the world claims its generation once, before its first restore or save;
before it writes, rank 0 checks that no newer world claimed the root. A world that lost the root raises
:class:`StaleGenerationError`, or, under the workers' own fence, :class:`WorldSupersededExit` (one line says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastrain import fence
from elastrain.checkpoint.group import Group
from elastrain.errors import StaleGenerationError, WorldSupersededExit
from elastrain.fence import World
from elastrain.storage import Storage


def check_fence(root: str, generation: int | None, storage: Storage) -> None:
    """:func:`elastrain.fence.check`: :class:`StaleGenerationError` if a newer world claimed ``root``."""
    fence.check(root, generation, storage)


class WorldFence:
    """This world's generation in one checkpoint root: its claim, the check before a write, and the verdict."""

    def __init__(
        self,
        root: str,
        storage: Storage,
        group: Group,
        *,
        generation: int | None,
        log: Callable[..., None],
        check: Callable[[str, int | None, Storage], None] | None = None,
        claim_as: World | None = None,
    ) -> None:
        """``check(root, generation, storage)`` raises :class:`StaleGenerationError` for a stale world (default
        :func:`check_fence`). ``claim_as``: the world claims its own generation in ``root`` (see
        :func:`elastrain.fence.worker_world`), and ``generation`` is then the claim's."""
        self.root = root
        self.storage = storage
        self.group = group
        self.claim_as = claim_as
        self.generation = generation if claim_as is None else None
        self.log = log
        self._check = check or check_fence

    def claim(self) -> int | None:
        """Collective, once: this world's generation in the root, claimed where the workers fence it themselves
        (:class:`elastrain.fence.WorkerClaim`); a world that lost the root raises :meth:`stale`'s."""
        if self.claim_as is None or self.generation is not None:
            return self.generation
        try:
            self.generation = fence.WorkerClaim(self.root, self.claim_as, self.storage).claim(self.group)
        except StaleGenerationError as e:
            raise self.stale(str(e)) from None
        self.log("generation_claimed", generation=self.generation, root=self.root, by="workers")
        return self.generation

    def check(self) -> None:
        """Rank 0: :class:`StaleGenerationError` if a newer world claimed the root (``OSError`` on storage trouble)."""
        self._check(self.root, self.generation, self.storage)

    def stale(self, message: str) -> BaseException:
        """What a world that lost the root raises: the launcher's fence stops its workers itself; with the workers'
        own fence, the workers exit with EX_CONFIG (one line says why), so that no restart claims the root back."""
        if self.claim_as is None:
            return StaleGenerationError(message)
        if self.group.rank == 0:
            self.log(
                "world_superseded",
                logging.ERROR,
                root=self.root,
                generation=self.generation,
                why=message,
                action="this world stops: its workers exit with EX_CONFIG (78) and elastrain-run ends its nodes",
            )
        return WorldSupersededExit(message)
