"""The Session's own errors."""

from __future__ import annotations

from elastrain.errors import ElastrainError


class SessionError(ElastrainError):
    """The training loop used the session out of order."""


class SessionConfigError(SessionError, ValueError):
    """A Session setting is missing or out of range; the message names it."""

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        super().__init__(f"Session({setting}=...): {message}")
