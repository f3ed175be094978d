"""The project's error types: each one says what was wrong and what to do."""


class ProtoFLError(Exception):
    """Base class of every error this package raises on purpose."""


class WireError(ProtoFLError, ValueError):
    """A message could not be decoded or failed validation; the receiver drops it."""


class ConfigError(ProtoFLError, ValueError):
    """A configuration value, preset or profile is invalid or unknown."""


class DataError(ProtoFLError, ValueError):
    """A dataset is missing, malformed, or cannot be partitioned as asked."""


class RevokedError(ProtoFLError):
    """The broker refuses a device's credentials after it had let it in: the fleet revoked it (or changed its
    password). `protofl-edge join` exits with its own status for it (edge_agent/join_cli.py: EXIT_REVOKED)."""
