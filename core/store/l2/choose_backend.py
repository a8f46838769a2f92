"""The one place that maps an ``--l2`` address to its backend class, like ``choose_placement`` for placements."""

from __future__ import annotations

from kvstrata.core.store.l2.backend import TierBackend


def open_backend(address: str, *, password_file: str | None = None, timeout: float = 2.0) -> TierBackend:
    """The backend an ``--l2`` address names (``valkey://HOST:PORT[,HOST:PORT...]``, ``valkeys://`` for TLS)."""
    scheme, sep, _ = address.partition("://")
    if not sep:
        raise ValueError(f"--l2 {address!r}: expected SCHEME://HOST:PORT[,HOST:PORT...]")
    if scheme in ("valkey", "valkeys"):
        from kvstrata.core.store.l2.valkey_backend import ValkeyBackend

        return ValkeyBackend.from_address(address, password_file=password_file, timeout=timeout)
    raise ValueError(f"--l2 {address!r}: unknown scheme {scheme!r}; known: valkey, valkeys")
