"""The zero-code Trainer integration's own errors."""

from __future__ import annotations

from elastrain.errors import ElastrainError


class TrainerIntegrationError(ElastrainError):
    """The Trainer is set up in a way the zero-code integration cannot make elastic; names the setting."""
