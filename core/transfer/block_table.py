"""The engine's block ids for one load or store, as one immutable value.

An engine names the blocks of a request's KV in its own types (vLLM: lists per KV
group, TensorRT-LLM: a list, SGLang: a tensor of slots turned into pages). The
engine runtime turns them into a :class:`BlockTable` once, where they enter it
(the scheduler side planning a load or a store), and every later step passes that
value on as it is: the worker side, the placement that copies, the planner and the
wire (msgpack sends a tuple as an array) read it without converting it again.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class BlockTable(tuple):
    """One tuple of plain ``int`` block ids per KV group, in the engine's group order.

    A tuple, so it is immutable, compares equal to the same tuple of tuples, pickles (vLLM sends a load's spec
    from its scheduler to its workers) and goes onto the wire as it is. ``BlockTable(table)`` of a table is that
    same table: building it where the ids are already one costs nothing.
    """

    __slots__ = ()

    def __new__(cls, groups: Iterable[Sequence[int]] = ()) -> "BlockTable":
        if type(groups) is cls:
            return groups  # type: ignore[return-value]
        return super().__new__(cls, (g if type(g) is tuple and set(map(type, g)) <= {int} else tuple(map(int, g))
                                     for g in groups))

    @classmethod
    def prefix(cls, groups: Iterable[Sequence[int]], num_blocks: int) -> "BlockTable":
        """The first ``num_blocks`` blocks of every group (a store of the prompt's whole blocks)."""
        return cls(tuple(map(int, list(g)[:num_blocks])) for g in groups)

    @property
    def num_blocks(self) -> int:
        """Block ids in all groups together."""
        return sum(len(g) for g in self)

    def as_lists(self) -> list[list[int]]:
        """A copy as lists, for the hooks and reports typed ``list[list[int]]`` (a failed load's blocks)."""
        return [list(g) for g in self]

    def __repr__(self) -> str:
        return f"BlockTable({tuple(self)!r})"
