"""CUDA IPC plumbing across a real process boundary: memory regions and interprocess events.

A child process opens the parent's exported region from the plain-data handle
(through msgpack, as the server receives it), copies a pattern in on its own
stream and records the parent's interprocess event after the copy. The parent
makes its stream wait on that event (no CPU wait on the copy) and reads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgpack
import torch

CHILD = textwrap.dedent("""
    import sys, msgpack, torch
    from kvstrata.core.transfer.layouts import Region
    from kvstrata.native.cuda_ipc import open_region
    msg = msgpack.unpackb(open(sys.argv[1], "rb").read(), raw=False)
    region = Region.from_wire(msg["region"])
    t = open_region(region)
    assert t.numel() == region.size, (t.numel(), region.size)
    ok = bool((t == 7).all())
    ev = torch.cuda.Event.from_ipc_handle(t.device, msg["event"])
    s = torch.cuda.Stream(t.device)
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # the copy lands well after the parent starts waiting
        t.copy_(torch.arange(region.size, device=t.device, dtype=torch.int64).remainder(251).to(torch.uint8))
        ev.record(s)
    s.synchronize()
    print("opened-ok" if ok else "opened-wrong-bytes")
""")


def test_region_and_event_cross_the_process_boundary(tmp_path):
    from kvstrata.native.cuda_events import CudaEventBackend
    from kvstrata.native.cuda_ipc import export_region

    backing = torch.full((3 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    tensor = backing[1 << 20:]  # a view at an offset inside its storage
    region = export_region(tensor.contiguous() if not tensor.is_contiguous() else tensor)
    backend = CudaEventBackend("cuda:0")
    event = backend.create_layer_events(1)[0]
    handle = backend.export([event])[0]
    path = tmp_path / "handles.msgpack"
    path.write_bytes(msgpack.packb({"region": region.to_wire(), "event": handle}, use_bin_type=True))
    torch.cuda.synchronize()
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "opened-ok" in out.stdout
    backend.wait(event)  # GPU-side wait on the child's record
    expected = torch.arange(region.size, device="cuda:0", dtype=torch.int64).remainder(251).to(torch.uint8)
    assert tensor.equal(expected)
    assert (backing[: 1 << 20] == 7).all(), "the child wrote outside the exported region"
