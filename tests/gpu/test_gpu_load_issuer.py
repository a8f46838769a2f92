"""The copier's native issuing thread (``kvstrata.native.load_issuer``): planned work reaches the GPU in the order
it was planned, a slice is never landed before its program is submitted, and a program that fails on the native
thread fails the slices it carries without stopping the programs after it."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.arrival.gate import TransferFailed

BOUND = 60.0  # only catches a hang


@pytest.fixture()
def issuer():
    from kvstrata.native import cuda_ext
    from kvstrata.native.load_issuer import LoadIssuer

    issuer = LoadIssuer(cuda_ext.load(), 0)
    yield issuer
    issuer.close()


def _event():
    ev = torch.cuda.Event()
    ev.record()  # creates its handle
    return ev


def _copy_row(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """One {dst, src, bytes} row. Keep the tensor alive while it is recorded: the call reads it by address."""
    return torch.tensor([[dst.data_ptr(), src.data_ptr(), src.numel()]], dtype=torch.int64)


def test_a_slice_planned_in_a_program_lands_only_after_the_program_is_submitted(issuer):
    from kvstrata.native.load_issuer import IssuedSlice

    stream = torch.cuda.Stream()
    src = torch.arange(1 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    rows = _copy_row(dst, src)
    ev = _event()
    with issuer.program():
        issuer.memcpy_runs(rows.data_ptr(), 1, 0, stream.cuda_stream)
        issuer.event_record(ev.cuda_event, stream.cuda_stream)
        done = IssuedSlice(issuer, issuer.mark(), ev)
        assert not done.query()  # not submitted: never landed, whatever the event says
        assert done.mark[0] == 0
    done.synchronize()
    assert done.query() and done.mark[0] > 0
    assert torch.equal(dst.cpu(), src)


def test_what_a_program_hands_over_is_issued_before_the_program_ends_and_the_rest_after_it(issuer):
    """``hand_over`` (a staged slice's first copy, before its kernel is planned): the copy is issued and lands
    while the program is still being recorded; what is recorded after it waits for the program's end."""
    from kvstrata.native.load_issuer import IssuedSlice

    stream = torch.cuda.Stream()
    src = torch.arange(1 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    again = torch.zeros_like(dst)
    rows, rows_again = _copy_row(dst, src), _copy_row(again, src)
    first, second = _event(), _event()
    with issuer.program():
        issuer.memcpy_runs(rows.data_ptr(), 1, 0, stream.cuda_stream)
        issuer.event_record(first.cuda_event, stream.cuda_stream)
        copied = IssuedSlice(issuer, issuer.mark(), first)
        issuer.hand_over()
        copied.synchronize()  # inside the program: times out unless it was handed over
        assert copied.query() and torch.equal(dst.cpu(), src)
        issuer.memcpy_runs(rows_again.data_ptr(), 1, 0, stream.cuda_stream)
        issuer.event_record(second.cuda_event, stream.cuda_stream)
        rest = IssuedSlice(issuer, issuer.mark(), second)
        assert rest.mark[0] == 0 and not rest.query()
    rest.synchronize()
    assert rest.mark[0] > copied.mark[0] and torch.equal(again.cpu(), src)


def test_programs_from_two_threads_reach_the_stream_in_submission_order(issuer):
    """Each program overwrites the same bytes; the last submitted wins, whichever thread planned it."""
    import threading

    from kvstrata.native.load_issuer import IssuedSlice

    stream = torch.cuda.Stream()
    dst = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
    sources = [torch.full((4 << 20,), i, dtype=torch.uint8).pin_memory() for i in range(1, 9)]
    slices: list = []
    order: list[int] = []
    lock = threading.Lock()

    def plan(i: int) -> None:
        ev = _event()
        rows = _copy_row(dst, sources[i])
        with issuer.program():
            issuer.memcpy_runs(rows.data_ptr(), 1, 0, stream.cuda_stream)
            issuer.event_record(ev.cuda_event, stream.cuda_stream)
            done = IssuedSlice(issuer, issuer.mark(), ev)
            with lock:  # submitted when the block ends, still under the issuer's lock: this is the order
                order.append(i)
        slices.append(done)

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    for done in slices:
        done.synchronize()
    assert sorted(d.mark[0] for d in slices) == list(range(min(d.mark[0] for d in slices),
                                                           min(d.mark[0] for d in slices) + len(sources)))
    assert int(dst[0]) == order[-1] + 1 and bool((dst == order[-1] + 1).all())


def test_a_program_that_fails_on_the_native_thread_fails_its_slices_and_the_next_program_runs(issuer):
    from kvstrata.native.load_issuer import IssuedSlice

    stream = torch.cuda.Stream()
    bad_ev, good_ev = _event(), _event()
    with issuer.program():
        # kv=3 is refused by the launch's own checks, on the native thread
        issuer.copy(True, 0, 0, 0, 1, 3, 1, 0, 1, 1, 0, 16, 16, 16, 16, 1, 0, stream.cuda_stream)
        issuer.event_record(bad_ev.cuda_event, stream.cuda_stream)
        bad = IssuedSlice(issuer, issuer.mark(), bad_ev)
    with pytest.raises(TransferFailed, match="kv must be 1 or 2"):
        bad.wait(torch.cuda.current_stream())
    assert not bad.query()
    src = torch.ones(4096, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    rows = _copy_row(dst, src)
    with issuer.program():
        issuer.memcpy_runs(rows.data_ptr(), 1, 0, stream.cuda_stream)
        issuer.event_record(good_ev.cuda_event, stream.cuda_stream)
        good = IssuedSlice(issuer, issuer.mark(), good_ev)
    good.synchronize()
    assert torch.equal(dst.cpu(), src)


def test_a_call_outside_a_program_is_issued_before_it_returns(issuer):
    stream = torch.cuda.Stream()
    src = torch.full((1 << 16,), 7, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    rows = _copy_row(dst, src)
    issuer.memcpy_runs(rows.data_ptr(), 1, 0, stream.cuda_stream)
    stream.synchronize()  # covers the copy only if it was on the stream when the call returned
    assert torch.equal(dst.cpu(), src)
