"""The staged-slice writer's C++ (``native/csrc/staged_slices.cpp``) built for this host, so the CPU suite checks it
too: the CUDA extension that ships it builds only where CUDA is (``tests/gpu/test_gpu_staged_slices.py`` runs the
same checks through it). The file is compiled with a small C entry point of this test's own and loaded with
ctypes; skipped, with the reason, where no C++ compiler is found."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from staged_programs import (assert_slices_in_one_program_are_planned_one_by_one,
                             assert_writer_refuses_what_it_cannot_write)

CSRC = Path(__file__).resolve().parents[2] / "native" / "csrc"

ENTRY = r"""
#include <cstring>
#include <exception>
#include "staged_slices.h"

extern "C" int write_or_error(const int64_t* slices, int64_t n_slices, int64_t layers_per_piece,
                              const int64_t* kinds, int64_t n_kinds, const int64_t* jobs, int64_t* buffers,
                              int64_t n_buffers, int64_t first_piece, const int64_t* launch, int64_t* out,
                              int64_t capacity, int64_t* marks_at, int64_t* result, char* error, int64_t error_len) {
  try {
    auto r = kvstrata::write_staged_slices(slices, n_slices, layers_per_piece, kinds, n_kinds, jobs, buffers,
                                           n_buffers, first_piece, launch, out, capacity, marks_at);
    result[0] = r.first;
    result[1] = r.second;
    return 0;
  } catch (const std::exception& exc) {
    std::strncpy(error, exc.what(), error_len - 1);
    error[error_len - 1] = 0;
    return 1;
  }
}
"""


@pytest.fixture(scope="module")
def write_staged_slices(tmp_path_factory):
    """The writer as the extension binds it (addresses and counts in; (words, pieces) out; ValueError on what it
    refuses), from the C++ built here."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler (c++, g++, clang++) on PATH to build native/csrc/staged_slices.cpp")
    work = tmp_path_factory.mktemp("staged-slices")
    (work / "entry.cpp").write_text(ENTRY)
    library = work / "libstaged_slices.so"
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{CSRC}", str(work / "entry.cpp"),
                    str(CSRC / "staged_slices.cpp"), "-o", str(library)], check=True, timeout=300)
    entry = ctypes.CDLL(str(library)).write_or_error
    entry.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                      ctypes.c_int64]
    entry.restype = ctypes.c_int

    def write(*args: int) -> tuple[int, int]:
        result, error = np.zeros(2, dtype=np.int64), ctypes.create_string_buffer(512)
        if entry(*args, result.ctypes.data, error, len(error)):
            raise ValueError(error.value.decode())
        return int(result[0]), int(result[1])

    return write


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("objects", ["back-to-back", "uneven"])
@pytest.mark.parametrize("staging", ["whole-slices", "split-slices"])
def test_a_loads_slices_in_one_program_are_the_ops_of_planning_them_one_by_one(write_staged_slices, width: int,
                                                                                 objects: str, staging: str) -> None:
    assert_slices_in_one_program_are_planned_one_by_one(write_staged_slices, width, objects, staging)


def test_a_slice_outside_the_layers_is_refused_and_writes_nothing_usable(write_staged_slices) -> None:
    assert_writer_refuses_what_it_cannot_write(write_staged_slices)
