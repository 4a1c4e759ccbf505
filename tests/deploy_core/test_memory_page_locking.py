"""deploy_core.memory.page_locking: the table of page-locked ranges (CPU, with the driver's two calls recorded) and the
real cudaHostRegister round trip (CUDA; skipped here with the reason)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from deploy_core.memory import page_locking as host_memory

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


class _RecordingRuntime:
    """Stands in for the CUDA runtime's two registration calls on a machine without one, answering ``error``."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.calls: list[tuple] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802 - the runtime's name
        self.calls.append(("register", address, size, flags))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address))
        return 0


def _address(buf: np.ndarray) -> int:
    return int(buf.__array_interface__["data"][0])


def test_views_inside_a_registered_range_are_page_locked_and_others_are_not(monkeypatch):
    runtime = _RecordingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    buf = np.zeros(4096, np.uint8)
    base = _address(buf)
    assert host_memory.page_lock(base + 1024, 2048) == 0
    try:
        assert runtime.calls == [("register", base + 1024, 2048, 0)]
        assert host_memory.is_page_locked(buf[1024:3072])  # exactly the range
        assert host_memory.is_page_locked(buf[2000:2100].view(np.uint8))
        assert host_memory.is_page_locked(buf[1024:3072].view(np.float32).reshape(8, 64))
        assert not host_memory.is_page_locked(buf[1000:1100])  # starts before it
        assert not host_memory.is_page_locked(buf[3000:3100])  # ends after it
        assert not host_memory.is_page_locked(buf)
        assert not host_memory.is_page_locked(np.zeros(16, np.uint8))  # ordinary memory elsewhere
    finally:
        assert host_memory.page_unlock(base + 1024) == 0
    assert runtime.calls[-1] == ("unregister", base + 1024)
    assert not host_memory.is_page_locked(buf[1024:3072])
    assert (base + 1024, base + 3072) not in host_memory.page_locked_ranges()


def test_a_refused_registration_records_nothing_and_a_bad_size_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _RecordingRuntime(error=712))
    buf = np.zeros(64, np.uint8)
    before = host_memory.page_locked_ranges()
    assert host_memory.page_lock(_address(buf), 64) == 712
    assert host_memory.page_locked_ranges() == before and not host_memory.is_page_locked(buf)
    with pytest.raises(ValueError, match="size must be > 0"):
        host_memory.page_lock(_address(buf), 0)


@needs_cuda
def test_a_page_locked_mapping_is_known_to_torch_and_copies_to_the_gpu():
    mapping = mmap.mmap(-1, 1 << 20)
    view = np.frombuffer(mapping, np.float32)
    view[:] = np.arange(view.size, dtype=np.float32)
    address = _address(view)
    assert host_memory.page_lock(address, len(mapping)) == 0
    try:
        assert host_memory.is_page_locked(view[10:20])
        host = torch.from_numpy(view)
        assert host.is_pinned()  # the driver agrees with the table
        on_gpu = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(on_gpu.cpu().numpy(), view)
        del host
    finally:
        assert host_memory.page_unlock(address) == 0
    assert not host_memory.is_page_locked(view) and not torch.from_numpy(view).is_pinned()
    del view
    mapping.close()
