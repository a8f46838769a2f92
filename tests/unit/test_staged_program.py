"""The staged slices' program words, built with array operations, against the op sequence written out piece by
piece (the form the executor wrote before: the specification of what the native issuer must receive)."""

import numpy as np
import pytest

from kvstrata.native.load_issuer import OP_COPY, OP_MARK, OP_MEMCPY2D, OP_RECORD_EVENT, OP_WAIT_EVENT
from kvstrata.native.staged_program import PieceTemplate, StagedStreams, staged_slices_words


def written_piece_by_piece(s, pieces, templates, events, first_buffer, used):
    used = list(used)
    words = []
    b_next = first_buffer
    for piece_list, event in zip(pieces, events):
        for first, count in piece_list:
            b = b_next % len(s.stages)
            b_next += 1
            t = templates[count]
            jobs = np.asarray(t.jobs, dtype=np.int64).reshape(-1, 6).copy()
            jobs[:, 0] += s.stages[b]
            jobs[:, 2] += first * np.asarray(t.host_shift, dtype=np.int64)
            if used[b]:
                words += (OP_WAIT_EVENT, 2, s.copy_stream, s.idle_events[b])
            words += (OP_MEMCPY2D, 2 + 6 * len(jobs), s.copy_stream, len(jobs))
            words += jobs.ravel().tolist()
            words += (OP_RECORD_EVENT, 2, s.filled_events[b], s.copy_stream, OP_WAIT_EVENT, 2, s.kernel_stream,
                      s.filled_events[b])
            words += (OP_COPY, 18, 1, s.planes, t.table, s.stages[b], s.n_tok, s.kv, s.num_layers, first, count, count,
                      0, s.row_bytes, s.head_bytes, s.head_stride, t.vec, s.max_ctas, s.device, s.kernel_stream)
            words += (OP_RECORD_EVENT, 2, s.idle_events[b], s.kernel_stream)
            used[b] = True
        words += (OP_RECORD_EVENT, 2, event, s.kernel_stream, OP_MARK, 1, 0)
    return np.asarray(words, dtype=np.int64), used


STREAMS = StagedStreams(copy_stream=0x7f00_0001_0000, kernel_stream=0x7f00_0002_0000,
                        stages=[0x7e00_0000_0000, 0x7e00_1000_0000, 0x7e00_2000_0000],
                        idle_events=[0x5a01, 0x5a02, 0x5a03], filled_events=[0x5b01, 0x5b02, 0x5b03],
                        planes=0x7d00_0000_0000, n_tok=4096, kv=2, num_layers=80, row_bytes=256, head_bytes=256,
                        head_stride=256, max_ctas=264, device=0)
ONE_JOB = {  # objects back to back: one 2D job a piece, one host step a layer
    1: PieceTemplate(np.asarray([0, 1 << 20, 0x6000_0000_0000, 80 << 20, 1 << 20, 32]), 1 << 20, 0x7c01, 16),
    2: PieceTemplate(np.asarray([0, 2 << 20, 0x6000_0000_0000, 80 << 20, 2 << 20, 32]), 1 << 20, 0x7c02, 16),
}
JOBS = {  # objects elsewhere: several jobs a piece, each with its own host step
    1: PieceTemplate(np.asarray([[0, 4096, 0x6000_0000_0000, 8192, 4096, 2], [8192, 2048, 0x6100_0000_0000, 4096, 2048, 2],
                                 [12288, 2048, 0x6200_0000_0000, 4096, 2048, 2]]), np.asarray([4096, 2048, 2048]),
                     0x7c11, 8),
    3: PieceTemplate(np.asarray([[0, 12288, 0x6000_0000_0000, 8192, 12288, 2],
                                 [24576, 6144, 0x6100_0000_0000, 4096, 6144, 2],
                                 [36864, 6144, 0x6200_0000_0000, 4096, 6144, 2]]), np.asarray([4096, 2048, 2048]),
                     0x7c13, 8),
}


@pytest.mark.parametrize("templates,pieces,first_buffer,used", [
    (ONE_JOB, [[(layer, 1)] for layer in range(1, 80)], 1, [True, True, True]),  # width 1 after the first layer
    (ONE_JOB, [[(1, 2), (3, 2), (5, 1)], [(6, 2), (8, 2), (10, 1)]], 0, [False, True, False]),  # mixed sizes
    (JOBS, [[(1, 3), (4, 1)], [(5, 3)], [(8, 1)]], 2, [True, False, True]),
])
def test_the_array_built_program_is_the_one_written_piece_by_piece(templates, pieces, first_buffer, used):
    events = [0x4000 + i for i in range(len(pieces))]
    expected, expected_used = written_piece_by_piece(STREAMS, pieces, templates, events, first_buffer, used)
    words, used_after = staged_slices_words(STREAMS, pieces, templates, events, first_buffer, used)
    assert words.dtype == np.int64
    assert words.tolist() == expected.tolist()
    assert used_after == expected_used
