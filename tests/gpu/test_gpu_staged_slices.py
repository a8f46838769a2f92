"""The CUDA extension's ``write_staged_slices`` (``native/csrc/staged_slices.h``, bound in ``binding.cpp``): a load's
later slices written into one program are exactly the ops of planning them slice by slice, and what it cannot write
is refused. Needs the extension, not the device: every address is a plain number and the programs are only recorded
(``tests/staged_programs.py``). That the copies land byte-exact is ``test_gpu_kernels.py``'s and the placement
tests'.
"""

from __future__ import annotations

import pytest

from staged_programs import (assert_slices_in_one_program_are_planned_one_by_one,
                             assert_writer_refuses_what_it_cannot_write)


@pytest.fixture(scope="module")
def extension():
    from kvstrata.native import cuda_ext

    return cuda_ext.load()


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("objects", ["back-to-back", "uneven"])
@pytest.mark.parametrize("staging", ["whole-slices", "split-slices"])
def test_a_loads_slices_in_one_program_are_the_ops_of_planning_them_one_by_one(extension, width: int, objects: str,
                                                                                 staging: str) -> None:
    assert_slices_in_one_program_are_planned_one_by_one(extension.write_staged_slices, width, objects, staging)


def test_a_slice_outside_the_layers_is_refused_and_writes_nothing_usable(extension) -> None:
    assert_writer_refuses_what_it_cannot_write(extension.write_staged_slices)
