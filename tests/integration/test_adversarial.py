"""Nothing one connection does can corrupt, starve or outlive another engine.

Each test runs an attack a hostile or buggy neighbour could make against a real ``kvstrata serve`` (a second
connection, an engine process killed or stopped, a flood of requests) and then checks that the honest engine's
stored prompts still read back exact and that the server let go of what the attacker held. Waits are bounded
only to catch hangs: every state a test needs is held (a lease that cannot run out while it matters, a slice
hold), never raced for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from kvstrata.core.engine.engine_placement import EnginePlacement
from kvstrata.core.engine.registration_area import RegistrationArea
from kvstrata.core.store.keys import CacheKey
from kvstrata.adapters.reference.engine import ReferenceEngine
from kvstrata.server_process import ServerProcess
from kvstrata.core.wire.client import CacheClient
from kvstrata.core.wire.protocol import RequestType
from kvstrata.core.wire.transport import RemoteError

from helpers import SMALL_32, random_prompt, submit_unchecked

TOKENS = 256
"""A prompt: 1 MiB of SMALL_32's KV, so the 4 MiB pool holds four."""
POOL = 4 << 20
LEASE = 3.0
ENGINE_SCRIPT = Path(__file__).with_name("adversarial_engine.py")


def eventually(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait until ``condition()``; the bound only catches a hang (nothing here depends on how fast)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(l1_bytes=POOL, chunk_size=64, extra_args=["--lease-seconds", str(LEASE)]) as srv:
        yield srv


class Honest:
    """An honest engine: its own connection and cache, prompts it stored and reads back."""

    def __init__(self, address: str, instance: int) -> None:
        self.client = CacheClient(address, timeout=30.0)
        self.engine = ReferenceEngine(SMALL_32, num_blocks=3 * TOKENS // 16, block_size=16)
        self.instance = instance
        self.client.register_kv_cache(instance, self.engine.layout, "server")

    def store(self, prompt: list[int]) -> dict[str, Any]:
        blocks = self.engine.allocate(TOKENS)
        try:
            self.engine.prefill(prompt, blocks)
            return self.client.store(CacheKey.for_tokens(f"s{self.instance}", prompt, model="m"), self.instance,
                                     [blocks])
        finally:
            self.engine.free(blocks)

    def owner(self, name: str) -> str:
        return f"{name}@i{self.instance}"

    def reads_back_exact(self, prompt: list[int], name: str) -> bool:
        key = CacheKey.for_tokens(self.owner(name), prompt, model="m")
        if self.client.lookup(key) != TOKENS:
            return False
        dst = self.engine.allocate(TOKENS)
        try:
            self.engine.clear(dst)
            self.client.retrieve(key, self.instance, [dst])
            return self.engine.mismatched_layers(prompt, dst, 0, TOKENS) == []
        finally:
            self.engine.free(dst)

    def close(self) -> None:
        self.client.close()
        self.engine.close()


def flood(address: str, instance: int, count: int, seed: int) -> None:
    """Another engine storing ``count`` fresh prompts: enough to evict and reuse every unlocked object."""
    other = Honest(address, instance)
    try:
        for i in range(count):
            assert other.store(random_prompt(TOKENS, seed=seed + i))["stored_tokens"] == TOKENS
    finally:
        other.close()


def answer(call: Callable[[], Any]) -> str:
    """What the server answered a request: its value, or its error code and message."""
    try:
        return f"ok {call()!r}"
    except RemoteError as exc:
        return f"{exc.code}: {exc}"


def state(client: CacheClient) -> dict[str, Any]:
    info = client.server_info()
    return {"locked": info["l1"]["locked_objects"], "instances": info["instances"], "free": info["l1"]["free_bytes"]}


def test_another_connection_can_neither_free_nor_use_an_engines_lookup_locks(server):
    victim = Honest(server.address, 100)
    attacker = CacheClient(server.address, timeout=30.0)
    try:
        prompt = random_prompt(TOKENS, seed=1)
        victim.store(prompt)
        held = CacheKey.for_tokens(victim.owner("req"), prompt, model="m")
        assert victim.client.lookup(held) == TOKENS
        locked = state(attacker)["locked"]
        answers = {
            "FREE_LOOKUP_LOCKS": answer(lambda: attacker.free_lookup_locks(held.request_id)),
            "END_SESSION": answer(lambda: attacker.transport.wait(
                submit_unchecked(attacker.transport, 7, [held.request_id]))),
            "RETRIEVE, unknown instance": answer(lambda: attacker.retrieve(held, 999, [[0]])),
            "RETRIEVE into the victim's instance": answer(lambda: attacker.retrieve(held, victim.instance, [[0]])),
            "LOOKUP under the victim's owner": answer(lambda: attacker.lookup(held)),
        }
        print("\nattacks on held lookup locks:", *(f"  {k} -> {v}" for k, v in answers.items()), sep="\n")
        assert answers["FREE_LOOKUP_LOCKS"].startswith("not_owner:")
        assert answers["END_SESSION"].startswith("bad_request:"), "END_SESSION is retired"
        assert answers["RETRIEVE, unknown instance"].startswith("not_owner:")
        assert answers["RETRIEVE into the victim's instance"].startswith("not_owner:")
        assert answers["LOOKUP under the victim's owner"].startswith("not_owner:")
        assert state(attacker)["locked"] == locked, "a refused request freed nothing"
        flood(server.address, 101, 24, seed=1000)  # evicts whatever is not locked, many times over
        dst = victim.engine.allocate(TOKENS)
        victim.engine.clear(dst)
        victim.client.retrieve(held, victim.instance, [dst])
        assert victim.engine.mismatched_layers(prompt, dst, 0, TOKENS) == [], "the held prompt read back exact"
    finally:
        attacker.close()
        victim.close()


def test_a_connection_cannot_register_another_engines_cache_and_write_into_it(server):
    victim = Honest(server.address, 110)
    attacker = CacheClient(server.address, timeout=30.0)
    try:
        prompt = random_prompt(TOKENS, seed=2)
        victim.store(prompt)
        before = victim.engine.regions[0].clone()
        # the victim's own descriptor, as anyone could rebuild it from /dev/shm's listing
        descriptor = victim.engine.layout.to_wire("server")
        registered = answer(lambda: attacker.transport.call(RequestType.REGISTER_KV_CACHE, [111, descriptor]))
        key = CacheKey.for_tokens("steal", prompt, model="m")
        assert attacker.lookup(key) == TOKENS
        retrieved = answer(lambda: attacker.retrieve(key, 111, [list(range(16))]))
        print(f"\nREGISTER of another engine's segment -> {registered}\nRETRIEVE into it -> {retrieved}")
        assert "no proof that the registering process owns this memory" in registered
        assert retrieved.startswith("unknown_instance:")
        assert attacker.free_lookup_locks("steal") > 0
        assert bytes(victim.engine.regions[0].numpy()) == bytes(before.numpy()), "not a byte of its cache changed"
        assert victim.reads_back_exact(prompt, "after-steal")
    finally:
        attacker.close()
        victim.close()


def test_one_connection_cannot_take_the_pool_and_what_it_reserved_goes_with_it(server):
    victim = Honest(server.address, 120)
    engine = ReferenceEngine(SMALL_32, num_blocks=2 * TOKENS // 16, block_size=16)
    attacker = CacheClient(server.address, timeout=30.0)
    area = RegistrationArea(engine.layout, chunk_size=64)
    hog = EnginePlacement(attacker, 121, engine.layout, local_regions=engine.regions,
                          registration_layout=area.layout, pool_writable=True)
    try:
        hog.register()
        huge = random_prompt(2 * POOL // (TOKENS * 4096) * TOKENS, seed=3)  # twice the pool
        reply = attacker.reserve_store(CacheKey.for_tokens("hog", huge, model="m"), 121)
        reserved = sum(o[1] for o in reply["objects"])
        print(f"\nRESERVE_STORE of twice the pool -> {len(reply['objects'])} objects, {reserved} bytes; "
              f"full: {reply['full']}")
        assert reserved <= POOL // 2 and "max_reserved_fraction" in reply["full"]
        # another engine's prompt the hog reserved and never commits is not reported as stored
        contested = huge[:TOKENS]
        victim_reply = victim.store(contested)
        print(f"STORE of a prompt another connection reserved -> {victim_reply}")
        assert victim_reply == {"stored_tokens": 0, "skipped_tokens": 0, "in_progress_tokens": TOKENS}
        assert victim.client.lookup(CacheKey.for_tokens("probe", contested, model="m")) == 0
        # the other half of the pool still serves honest engines
        for i in range(4):
            prompt = random_prompt(TOKENS, seed=30 + i)
            assert victim.store(prompt)["stored_tokens"] == TOKENS
            assert victim.reads_back_exact(prompt, f"beside-hog-{i}")
        attacker.close()  # the hog goes: its reservations with it
        eventually(lambda: 121 not in state(victim.client)["instances"], "the hog's instance released")
        eventually(lambda: state(victim.client)["locked"] == 0, "the hog's reservations released")
        assert victim.store(contested)["stored_tokens"] == TOKENS
        assert victim.reads_back_exact(contested, "after-hog")
    finally:
        attacker.close()
        hog.close()
        area.close()
        engine.close()
        victim.close()


def test_a_flood_of_registrations_and_oversized_keys_is_refused_by_named_limits(server):
    attacker = CacheClient(server.address, timeout=30.0)
    engine = ReferenceEngine(SMALL_32, num_blocks=16, block_size=16)
    try:
        answers = []
        for i in range(1100):
            answers.append(answer(lambda i=i: attacker.register_kv_cache(2000 + i, engine.layout, "server")))
        refused = [a for a in answers if not a.startswith("ok")]
        print(f"\n1,100 REGISTERs from one connection -> {len(answers) - len(refused)} accepted, {len(refused)} "
              f"refused: {refused[0]}")
        assert len(answers) - len(refused) == 64 and all("max_instances_per_connection" in a for a in refused)
        long_prompt = list(range(1 << 20)) + [1]
        too_long = answer(lambda: attacker.lookup(CacheKey.for_tokens("long", long_prompt, model="m")))
        long_id = answer(lambda: attacker.lookup(CacheKey.for_tokens("x" * (1 << 20), [1, 2, 3], model="m")))
        print(f"LOOKUP of {len(long_prompt)} tokens -> {too_long}\nLOOKUP with a 1 MiB request id -> {long_id}")
        assert "max_prompt_tokens" in too_long and "max_request_id_bytes" in long_id
        honest = Honest(server.address, 130)  # another engine still registers and serves
        try:
            prompt = random_prompt(TOKENS, seed=4)
            honest.store(prompt)
            assert honest.reads_back_exact(prompt, "after-flood")
        finally:
            honest.close()
    finally:
        attacker.close()
        probe = CacheClient(server.address, timeout=30.0)
        try:
            eventually(lambda: not any(2000 <= i < 3100 for i in state(probe)["instances"]),
                       "the flooding connection's instances released")
        finally:
            probe.close()
        engine.close()


class EngineProcess:
    """``adversarial_engine.py`` in a child process (see its docstring)."""

    def __init__(self, address: str, instance: int, seed: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), address, str(instance), str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.instance = instance
        line = self.proc.stdout.readline().strip()
        assert line == "ready", f"the engine process did not start: {line!r}"

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self) -> None:
        self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


def test_an_engine_killed_while_holding_state_leaves_nothing_behind(server):
    probe = CacheClient(server.address, timeout=30.0)
    engine = EngineProcess(server.address, 140, seed=5)
    try:
        held = state(probe)
        assert {140, 141} <= set(held["instances"]) and held["locked"] > 0
        engine.signal(signal.SIGKILL)
        engine.wait()
        eventually(lambda: not {140, 141} & set(state(probe)["instances"]), "the killed engine's instances released")
        eventually(lambda: state(probe)["locked"] == 0, "its lookup locks and reservations released")
        print(f"\nSIGKILLed engine: held {held}, then {state(probe)}")
    finally:
        engine.close()
        probe.close()


def test_a_stopped_engine_loses_its_state_when_its_lease_ends_and_its_next_load_fails_cleanly(server):
    probe = CacheClient(server.address, timeout=30.0)
    engine = EngineProcess(server.address, 150, seed=6)
    try:
        held = state(probe)
        assert {150, 151} <= set(held["instances"]) and held["locked"] > 0
        engine.signal(signal.SIGSTOP)  # connected, silent: only the lease can tell
        eventually(lambda: not {150, 151} & set(state(probe)["instances"]), "the stopped engine's lease ended")
        eventually(lambda: state(probe)["locked"] == 0, "its lookup locks and reservations released")
        flood(server.address, 152, 8, seed=2000)  # its chunks may be evicted and reused now
        engine.signal(signal.SIGCONT)
        outcome = engine.ask("load")
        print(f"\nSIGSTOPped engine: held {held}; after its lease: {state(probe)}; its load on waking -> {outcome}")
        assert outcome.startswith("failed unknown_instance:"), "a clear failure, never stale bytes"
    finally:
        engine.close()
        probe.close()


def server_handles(pid: int) -> tuple[int, int]:
    """(open file descriptors, shared-memory mappings) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/" in line)
    return fds, maps


def engine_waves(server: ServerProcess, waves: int, per_wave: int, seed: int) -> list[tuple[int, int]]:
    """Waves of engine processes, each taking every kind of state; the first of each wave is killed, the next
    stopped until its lease ends, the rest exit without cleaning up. Returns the server's handles per wave."""
    probe = CacheClient(server.address, timeout=30.0)
    seen = []
    try:
        for wave in range(waves):
            engines = [EngineProcess(server.address, 3200 + 10 * (wave * per_wave + i), seed + wave * 10 + i)
                       for i in range(per_wave)]
            seen.append(server_handles(server.proc.pid))
            for i, engine in enumerate(engines):
                if i == 0:
                    engine.signal(signal.SIGKILL)
                elif i == 1:
                    engine.signal(signal.SIGSTOP)
                else:
                    engine.ask("exit")
            eventually(lambda: not any(i >= 3200 for i in state(probe)["instances"]), "every engine let go")
            for engine in engines:
                engine.signal(signal.SIGCONT)
                engine.close()
    finally:
        probe.close()
    return seen


def test_the_servers_files_and_mappings_return_to_their_start_after_engines_come_and_go(server):
    probe = CacheClient(server.address, timeout=30.0)
    try:
        # the earlier tests' connections are gone: wait until the server has let go of all they held
        eventually(lambda: state(probe)["instances"] == [] and state(probe)["locked"] == 0, "a quiet server")
        start = server_handles(server.proc.pid)
        peaks = engine_waves(server, waves=3, per_wave=3, seed=7000)
        eventually(lambda: server_handles(server.proc.pid) == start, "the server's handles back to their start")
        print(f"\nserver (fds, /dev/shm mappings): start {start}, with engines {peaks}, after "
              f"{server_handles(server.proc.pid)}")
        assert state(probe)["locked"] == 0
    finally:
        probe.close()


@pytest.mark.soak
def test_soak_engines_restarting_for_two_minutes_leave_no_files_or_mappings():
    with ServerProcess(l1_bytes=POOL, chunk_size=64, extra_args=["--lease-seconds", str(LEASE)]) as srv:
        probe = CacheClient(srv.address, timeout=30.0)
        try:
            probe.ping()
            start = server_handles(srv.proc.pid)
            began = time.monotonic()
            waves = 0
            while time.monotonic() - began < 120:
                engine_waves(srv, waves=1, per_wave=4, seed=9000 + 10 * waves)
                waves += 1
            eventually(lambda: server_handles(srv.proc.pid) == start, "the server's handles back to their start")
            print(f"\nsoak: {waves} waves of 4 engines in {time.monotonic() - began:.0f} s; server (fds, /dev/shm "
                  f"mappings) at start {start}, after {server_handles(srv.proc.pid)}")
        finally:
            probe.close()
