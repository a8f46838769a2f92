"""Who holds what on the server: every piece of state belongs to one connection, and goes with it.

A connection is one client socket (its ZMQ routing id, random and never shown to
another client). What it registers or takes on the server (cache instances, store
reservations, the arrival boards it names, lookup locks) is recorded on its
:class:`Connection`, and :meth:`CacheServer.end_connection` lets all of it go when
the connection disconnects or when its lease runs out: a client renews its lease
with every request and its transport sends a heartbeat every
:data:`~kvstrata.core.wire.transport.HEARTBEAT_S` seconds, so only a stopped or
hung process stays silent that long. The limits on what it may hold are per connection, so one
client cannot take what the others need (:class:`~kvstrata.core.server.config.ConnectionLimits`, settings
of ``kvstrata serve``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Connection:
    """What one client connection holds on the server."""

    identity: bytes | None
    """Its ZMQ routing id; None for calls made inside the server process (tests calling handlers)."""
    instances: set[int] = field(default_factory=set)
    boards: dict[str, Any] = field(default_factory=dict)
    """Arrival boards its RETRIEVEs named, mapped once, by segment name."""
    owners: set[str] = field(default_factory=set)
    """Lock owners whose lookup locks it holds."""
    reservations: set[int] = field(default_factory=set)
    reserved_bytes: int = 0
    ended: bool = False
    """Disconnected or its lease ran out: it holds nothing new; its boards close once no transfer uses them."""

    def label(self) -> str:
        return "in-process" if self.identity is None else self.identity.hex()[:12]
