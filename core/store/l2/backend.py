"""What a shared tier's store must provide (``choose_backend`` picks the one an ``--l2`` address names).

A backend moves opaque values by name; what a value holds and whether it checks out is
:mod:`kvstrata.core.store.l2.value`'s business. Every call is bounded: a store that does not answer in time
raises :class:`TierUnavailable`, which the caller counts and treats as a miss, never as a wait.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Sequence


class TierUnavailable(Exception):
    """The store did not answer (a node down, a timeout, a failover in progress)."""


class TierBackend(Protocol):
    scheme: ClassVar[str]
    """The address scheme that selects this backend (``valkey``)."""

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The values stored under ``names``, in order (None where there is none)."""

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Whether a value is stored under each of ``names``, in order (without reading them)."""

    def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store each value under its name (replacing what was there)."""

    def direct_reader(self) -> Any:
        """A reader that receives values straight into the pool (``read_into``, see
        :class:`~kvstrata.core.store.l2.valkey_reader.DirectReader`) for one thread, or None where this backend
        has none and its ``get_many`` values are copied in."""

    def describe(self) -> dict[str, Any]:
        """Its nodes, whether each answers, and what each holds (``used_bytes``, ``max_bytes``, ``values``), for
        ``kvstrata status``; may take up to the timeout per node that does not answer."""

    def close(self) -> None: ...
