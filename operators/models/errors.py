"""The error every model loader raises: at the bottom, so the loaders beside it share one class."""

from __future__ import annotations

from flowrl.errors import ConfigError


class ModelLoadError(ConfigError, ValueError):
    """A model spec could not be turned into a model: says which spec and why."""
