"""A seeded, bounded fuzz of a real server: random frames, random payloads, and well-formed abuse.

One engine (the victim) registers its cache and stores prompts; an attacker on
another connection then sends, phase by phase, random frames, random payloads
for every request type, and well-formed requests that name the wrong memory
(segments, board references, descriptors, block ids, skips, sizes,
the victim's instance). After each phase PING answers, the victim's cache is
byte for byte what it was, and every prompt stored before reads back exact.
``-m soak`` runs the long version.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
from typing import Any, Callable

import pytest
import torch

from kvstrata.core.arrival.board import ArrivalBoard
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.store.keys import CacheKey
from kvstrata.core.wire.protocol import DECLARATIONS, RequestType
from kvstrata.core.shm import Segment
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.server_process import ServerProcess
from kvstrata.core.wire.transport import RemoteError, RequestTimeout

from helpers import SMALL_32, control_segment_of_unknown_kind, random_prompt, send_raw, submit_unchecked

SEED = 20261201
TOKENS = 128


class Fuzz:
    """The victim, the attacker, the memory the attacker names, and what was sent and answered."""

    def __init__(self, address: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()
        self.victim = CacheClient(address, timeout=30.0)
        self.attacker = CacheClient(address, timeout=30.0)
        self.victim_engine = ReferenceEngine(SMALL_32, num_blocks=3 * TOKENS // 16 + 8, block_size=16)
        self.own_engine = ReferenceEngine(SMALL_32, num_blocks=3 * TOKENS // 16 + 8, block_size=16)
        self.victim.register_kv_cache(0, self.victim_engine.layout, "server")
        self.attacker.register_kv_cache(1, self.own_engine.layout, "server")
        self.prompts = [random_prompt(TOKENS, seed=seed + i) for i in range(2)]
        for i, p in enumerate(self.prompts):
            blocks = self.victim_engine.allocate(TOKENS)
            self.victim_engine.prefill(p, blocks)
            self.victim.store(CacheKey.for_tokens(f"victim-store-{i}", p, model="m"), 0, [blocks])
            self.victim_engine.free(blocks)
        own = self.own_engine.allocate(TOKENS)
        self.own_engine.prefill(self.prompts[0], own)
        self.attacker.store(CacheKey.for_tokens("own-store", self.prompts[0], model="m"), 1, [own])
        self.own_blocks = own
        self.board = ArrivalBoard.create(2)
        self.unknown_kind = control_segment_of_unknown_kind()
        self.plain = Segment.create("other", 1 << 16)
        self.pool = self.attacker.server_info()["pool"]["name"]
        self.names = [self.pool, self.victim_engine.layout.regions[0].name, self.own_engine.layout.regions[0].name,
                      self.board.name, self.unknown_kind.name, self.plain.name,
                      "kvstrata-board-1-00000000", "../../dev/zero", "", "x" * 300]
        self.snapshot = self.victim_engine.regions[0].clone()

    # --- sending --------------------------------------------------------------------------------------

    def send(self, rt: RequestType | int, payload: Any) -> None:
        """One request; its outcome counted by kind (an error's message with numbers and names taken out)."""
        self.counts["requests sent"] += 1
        try:
            self.attacker.transport.wait(submit_unchecked(self.attacker.transport, rt, payload), timeout=30.0)
            self.counts["accepted"] += 1
        except RemoteError as exc:
            self.counts["error: " + error_kind(str(exc))] += 1
        except RequestTimeout:
            self.counts["no reply (dropped as undecodable)"] += 1

    def key(self, rid: str, tokens: list[int] | None = None) -> dict[str, Any]:
        return CacheKey.for_tokens(rid, tokens if tokens is not None else self.prompts[0], model="m").to_wire()

    # --- what the attacker sends ---------------------------------------------------------------------

    def random_value(self, depth: int = 0) -> Any:
        r = self.rng.random()
        if depth > 2 or r < 0.35:
            return self.rng.choice([0, -1, 1, 2**31, 2**63 - 1, -2**63, 3.5, True, None, "", "x", b"", b"\x00" * 9,
                                    self.rng.randrange(-1000, 1000), self.rng.choice(self.names)])
        if r < 0.7:
            return [self.random_value(depth + 1) for _ in range(self.rng.randrange(0, 9))]
        keys = ["name", "slot", "generation", "kind", "size", "request_id", "tokens", "model", "world_size", "rank",
                "salt", "placement", "regions", "offsets", "slots", "slot_bytes"]
        return {self.rng.choice(keys): self.random_value(depth + 1) for _ in range(self.rng.randrange(0, 6))}

    def random_frames(self, rounds: int) -> None:
        from kvstrata.core.wire import codec

        template = codec.encode_request(1, RequestType.RETRIEVE, [self.key("m"), 1, [[0]], None, 0, None, None, 0])
        for _ in range(rounds):
            if self.rng.random() < 0.5:
                frame = bytes(self.rng.getrandbits(8) for _ in range(self.rng.randrange(0, 512)))
            else:
                frame = bytearray(template)
                for _ in range(self.rng.randrange(1, 8)):
                    frame[self.rng.randrange(len(frame))] = self.rng.getrandbits(8)
                frame = bytes(frame)
            send_raw(self.attacker.transport, frame)
            self.counts["frames sent"] += 1

    def random_payloads(self, rounds: int) -> None:
        types = list(DECLARATIONS)
        for _ in range(rounds):
            rt = self.rng.choice(types)
            arity = DECLARATIONS[rt].arity
            n = arity if self.rng.random() < 0.8 else self.rng.randrange(0, arity + 3)
            self.send(rt, [self.random_value() for _ in range(n)])

    def abuse(self, rounds: int) -> None:
        cases: list[Callable[[], None]] = [self.board_refs, self.other_connection, self.descriptors,
                                           self.block_ids_and_skips]
        for _ in range(rounds):
            self.rng.choice(cases)()

    def board_refs(self) -> None:
        rid = f"abuse-board-{self.rng.randrange(1 << 30)}"
        self.attacker.lookup(CacheKey.for_tokens(rid, self.prompts[0], model="m"))
        ref = {"name": self.rng.choice(self.names), "slot": self.rng.choice([0, 1, 2, 63, 1 << 20]),
               "generation": self.rng.choice([0, 1, 7, 1 << 32])}
        if ref["name"] == self.board.name and ref["slot"] < 2 and 0 < ref["generation"] < 1 << 32:
            ref["slot"] = self.rng.choice([2, 63])  # named validly, the board is the attacker's to write: never
        self.send(RequestType.RETRIEVE, [self.key(rid), 1, [self.own_blocks], None, 0, ref, None,
                                         self.rng.choice([0, 1, 4])])
        self.attacker.free_lookup_locks(rid)

    def other_connection(self) -> None:
        rid = f"abuse-victim-{self.rng.randrange(1 << 30)}"
        blocks = [list(range(TOKENS // 16))]
        choice = self.rng.randrange(4)
        if choice == 0:
            self.attacker.lookup(CacheKey.for_tokens(rid, self.prompts[1], model="m"))
            self.send(RequestType.RETRIEVE, [self.key(rid, self.prompts[1]), 0, blocks, None, 0, None, None, 0])
            self.attacker.free_lookup_locks(rid)
        elif choice == 1:
            self.send(RequestType.STORE, [self.key(rid, self.prompts[1]), 0, blocks, None, 0])
        elif choice == 2:
            self.send(RequestType.UNREGISTER_KV_CACHE, [0])
        else:
            self.send(RequestType.REGISTER_KV_CACHE, [0, self.own_engine.layout.to_wire("server")])

    def descriptors(self) -> None:
        d = self.own_engine.layout.to_wire(self.rng.choice(["server", "engine", "elsewhere"]))
        field = self.rng.choice(["block_stride", "token_stride", "head_stride", "num_blocks", "block_size",
                                 "num_heads", "head_bytes", "num_layers", "regions", "offsets", "dtype", "kv_size"])
        if field == "regions":
            d["regions"] = [{"kind": self.rng.choice(["shm", "cuda_ipc", "local", "dram"]),
                             "size": self.rng.choice([1, 4096, d["regions"][0]["size"], 1 << 40]),
                             "name": self.rng.choice(self.names), "handle": {}}]
        elif field == "offsets":
            d["offsets"] = [[[self.rng.choice([0, 1, -1]), self.rng.choice([0, -64, 1 << 40])]] * 2] * 32
        elif field == "dtype":
            d["dtype"] = self.rng.choice(["int64", "", "bfloat16 "])
        else:
            d[field] = self.rng.choice([0, -1, -d[field] if isinstance(d[field], int) else 0, 1 << 40, 3])
        self.send(RequestType.REGISTER_KV_CACHE, [self.rng.choice([1, 2, 7]), d])

    def block_ids_and_skips(self) -> None:
        rid = f"abuse-blocks-{self.rng.randrange(1 << 30)}"
        self.attacker.lookup(CacheKey.for_tokens(rid, self.prompts[0], model="m"))
        nb = self.own_engine.layout.num_blocks
        blocks = self.rng.choice([[[nb]], [self.own_blocks[:-1] + [nb + 5]], [], [self.own_blocks, self.own_blocks],
                                  [self.own_blocks[:2]], [[1 << 40] * 8]])
        skip = self.rng.choice([0, TOKENS + 1, 1 << 40])
        rt = self.rng.choice([RequestType.RETRIEVE, RequestType.STORE])
        if rt is RequestType.RETRIEVE:
            self.send(rt, [self.key(rid), 1, blocks, None, skip, None, None, 0])
        else:
            self.send(rt, [self.key(rid), 1, blocks, None, skip])
        self.attacker.free_lookup_locks(rid)

    # --- checks -------------------------------------------------------------------------------------------

    def check(self, phase: str) -> None:
        assert self.attacker.ping() == "pong", f"after {phase}: the server stopped answering"
        assert torch.equal(self.victim_engine.regions[0], self.snapshot), f"after {phase}: the victim's cache changed"
        assert bytes(self.board.segment.buf[64:]) == bytes(2 * 64), f"after {phase}: a board word was written"
        assert bytes(self.plain.buf) == bytes(len(self.plain.buf)), f"after {phase}: a plain segment was written"
        for i, p in enumerate(self.prompts):
            rid = f"check-{phase}-{i}"
            key = CacheKey.for_tokens(rid, p, model="m")
            assert self.victim.lookup(key) == TOKENS, f"after {phase}: prompt {i} is no longer cached"
            dst = self.victim_engine.allocate(TOKENS)
            self.victim_engine.clear(dst)
            self.victim.retrieve(key, 0, [dst])
            assert self.victim_engine.mismatched_layers(p, dst, 0, TOKENS) == [], f"after {phase}: prompt {i} differs"
            self.victim_engine.clear(dst)
            self.victim_engine.free(dst)
        self.snapshot = self.victim_engine.regions[0].clone()
        self.counts[f"checks passed after {phase}"] += 1

    def close(self) -> None:
        for thing in (self.board, self.unknown_kind, self.plain):
            thing.destroy()
        self.victim.close()
        self.attacker.close()
        self.victim_engine.close()
        self.own_engine.close()


KINDS = [
    ("payload has", "wrong item count"), ("must be CacheKey", "malformed key"), (") must be", "wrong item type"),
    ("belongs to another connection", "another connection's instance"),
    ("is registered by another connection", "another connection's instance"),
    ("is not registered", "unknown instance"), ("server's own L1 pool", "names the L1 pool"),
    ("carries no kvstrata control header", "segment is no control segment"),
    ("not an arrival board", "segment of another kind"),
    ("not an engine cache", "control segment as a cache"), ("no shared-memory segment", "no such segment"),
    ("invalid shared-memory segment name", "bad segment name"), ("slots; slot", "board slot out of range"),
    ("generation", "bad board generation"), ("block ids", "bad block ids"), ("KV groups", "bad block ids"),
    ("skip_first_n_tokens", "bad skip"), ("must be positive", "bad descriptor"), ("past region", "bad descriptor"),
    ("descriptor", "bad descriptor"), ("cannot be opened", "region larger than its segment"),
    ("region kinds", "bad descriptor"), ("placement must be", "bad descriptor"),
]


def error_kind(message: str) -> str:
    """An error reply's kind: its request type and what was wrong, in a few words."""
    rt, _, rest = message.partition(": ")
    for phrase, kind in KINDS:
        if phrase in rest:
            return f"{rt}: {kind}"
    return f"{rt}: {re.sub(r'-?[0-9]+', 'N', rest)[:60]}"


def run(address: str, rounds: int, seed: int = SEED) -> collections.Counter[str]:
    fuzz = Fuzz(address, seed)
    try:
        fuzz.check("setup")
        fuzz.random_frames(rounds)
        fuzz.check("random frames")
        fuzz.random_payloads(rounds)
        fuzz.check("random payloads")
        fuzz.abuse(rounds)
        fuzz.check("abuse")
        return fuzz.counts
    finally:
        fuzz.close()


def report(counts: collections.Counter[str], name: str) -> None:
    path = os.environ.get("KVSTRATA_FUZZ_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, "counts": dict(counts)}) + "\n")


def test_fuzz_the_server_writes_nothing_it_should_not_and_keeps_serving(tmp_path):
    with ServerProcess(l1_bytes=64 << 20, chunk_size=64) as srv:
        counts = run(srv.address, rounds=1000)
        assert srv.proc.poll() is None
    report(counts, "fuzz")
    assert counts["frames sent"] == 1000 and counts["requests sent"] >= 2000
    assert sum(v for k, v in counts.items() if k.startswith("error: ")) > 1000


@pytest.mark.soak
def test_fuzz_soak(tmp_path):
    with ServerProcess(l1_bytes=64 << 20, chunk_size=64) as srv:
        counts = run(srv.address, rounds=50000, seed=SEED + 1)
        assert srv.proc.poll() is None
    report(counts, "fuzz soak")
