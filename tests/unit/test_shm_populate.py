"""A populated segment has every page allocated when it is made; one larger than /dev/shm is refused first."""

import os

import pytest

from kvstrata.core.shm import SHM_DIR, Segment, SegmentTooLarge

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason=f"needs {SHM_DIR}")


def allocated_bytes(segment: Segment) -> int:
    return os.stat(os.path.join(SHM_DIR, segment.name)).st_blocks * 512


def test_a_populated_segment_has_every_page_allocated_and_a_plain_one_none() -> None:
    size = 8 << 20
    plain, populated = Segment.create("test-plain", size), Segment.create("test-populated", size, populate=True)
    try:
        assert allocated_bytes(plain) == 0 and plain.populate_seconds is None
        assert allocated_bytes(populated) >= size and populated.populate_seconds >= 0
        assert bytes(populated.buf[:4096]) == bytes(4096) and bytes(populated.buf[-4096:]) == bytes(4096)
    finally:
        plain.destroy()
        populated.destroy()


def test_a_segment_larger_than_the_free_room_is_refused_before_a_page_is_taken() -> None:
    fs = os.statvfs(SHM_DIR)
    too_large = fs.f_bavail * fs.f_frsize + (1 << 30)
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(SegmentTooLarge, match=r"/dev/shm has \d+ bytes free, fewer than the \d+ asked for"):
        Segment.create("test-too-large", too_large, populate=True)
    assert not {n for n in set(os.listdir(SHM_DIR)) - before if "test-too-large" in n}, "the file was left behind"
