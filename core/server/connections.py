"""Who holds what on the server: every piece of state belongs to one connection, and goes with it.

A connection is one client socket (its ZMQ routing id, random and never shown to
another client). What it registers or takes on the server (cache instances, store
reservations, the arrival boards it names, lookup locks) is recorded on its
:class:`Connection`, and :meth:`CacheServer.end_connection` lets all of it go when
the connection disconnects or when its lease runs out: a client renews its lease
with every request and its transport sends a heartbeat every
:data:`~kvstrata.core.wire.transport.HEARTBEAT_S` seconds, so only a stopped or
hung process stays silent that long. The limits here are per connection, so one
client cannot take what the others need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _limit(default: float, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may hold at once. Each field is a ``kvstrata serve`` flag and config key of the same
    name (its metadata's ``help`` is the flag's help), so the bounds are declared here once."""

    lease_seconds: float = _limit(30.0, "a connection silent this long (no request, no heartbeat) loses "
                                        "everything it holds (its client sends a heartbeat every second)")
    max_instances_per_connection: int = _limit(64, "caches one connection may register at once (an engine "
                                                   "process registers one per rank it serves); also bounds the "
                                                   "arrival boards it may name")
    max_reserved_fraction: float = _limit(0.5, "share of the L1 pool one connection's uncommitted store "
                                               "reservations may hold")
    max_lock_owners_per_connection: int = _limit(4096, "requests whose lookup locks one connection may hold at "
                                                       "once")
    max_prompt_tokens: int = _limit(1 << 20, "tokens one key (a prompt) may name")
    max_request_id_bytes: int = _limit(1024, "bytes of a key's request id (its lock owner)")

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")
        for name in ("max_instances_per_connection", "max_lock_owners_per_connection", "max_prompt_tokens",
                     "max_request_id_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 < self.max_reserved_fraction <= 1:
            raise ValueError(f"max_reserved_fraction must be in (0, 1], got {self.max_reserved_fraction}")


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
