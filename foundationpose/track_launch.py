"""How a batch of track requests gets into a track step's static buffers: PyTorch copies, or CUDA driver calls.

:func:`stack_frames` and :func:`copy_in` are the PyTorch path (the reference, used everywhere): the requests'
host rows, then one copy per field (or per frame for images the requests copied themselves) into the
:class:`~foundationpose.track_graph.TrackBuffers`.

Submitting a captured track step with CUDA driver calls that keep the GIL (:mod:`deploy_core.cuda_driver`):

A submit through PyTorch is ~12 calls that each release the GIL and take it back (pinned allocations, copies, the
stream switch, the replay, the event); with many Python threads busy, every retake can wait for another thread's
slice, and the submitting thread ends up waiting most of its wall time. :class:`DriverSubmit` enqueues the same work
without letting the GIL go: one host-to-device copy per image row and per small field, ``cuGraphLaunch`` of the
captured step, one device-to-host copy of the poses and one event record, in microseconds.

It needs a captured entry (its graph's executable handle) and page-locked sources: images staged by their requests
(:meth:`foundationpose.track_graph.TrackGraphRunner.host_images`: pinned tensors, or a page-locked ring's arrays); intrinsics and
start poses go through a ring of pinned :class:`LaunchSlot` s that it owns (one per submitted batch until collected).
Everything else keeps the PyTorch path, which is the reference twin: :func:`copy_plan` lists the copies both make,
and the CPU test checks that running the plan fills the buffers as :func:`copy_in` does, bit for bit.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deploy_core.cuda_driver import CudaDriver
from deploy_core.memory.page_locking import is_page_locked_array

__all__ = ["STACK_FROM", "DriverDone", "DriverSubmit", "HostCopy", "LaunchSlot", "LaunchSlots", "copy_in", "copy_plan",
           "copy_rows", "copy_rows_reference", "run_plan_on_host", "shared_rows", "stack_frames"]

_K_BYTES = 3 * 3 * 8  # one (3, 3) float64 K
_POSE_BYTES = 4 * 4 * 4  # one (4, 4) float32 pose


@dataclass(frozen=True, slots=True)
class HostCopy:
    """``nbytes`` from address ``src`` to address ``dst``: host to device in :class:`DriverSubmit`, or device to
    device when ``on_device`` (``src`` is a row an earlier copy of the same plan filled)."""

    dst: int
    src: int
    nbytes: int
    on_device: bool = False


def _address(image: Tensor | np.ndarray) -> int:
    if isinstance(image, Tensor):
        return image.data_ptr()
    return image.__array_interface__["data"][0]


def copy_plan(buffers: Any, rgbs: Sequence[Tensor | np.ndarray], depths: Sequence[Tensor | np.ndarray],
              ks: Tensor, starts: Tensor, objects: Tensor | None = None) -> list[HostCopy]:
    """The copies that put ``n = len(rgbs)`` requests into rows ``0..n-1`` of a :class:`TrackBuffers`: each frame's
    rgb and depth row, then K rows and start rows in one copy each from ``ks`` / ``starts`` (contiguous host
    tensors holding at least n rows), and with ``objects`` (an int64 host tensor of at least n rows: a step over
    several objects) the row-object indices in one copy. Images must be C-contiguous (H, W, 3) uint8 / (H, W) float32 of the buffers'
    image size (the runner checked the shapes). Rows that read the same image (the objects of one frame, staged
    once: :meth:`foundationpose.service.PoseService.share_frame`) cross to the GPU once: the later rows copy the
    first one's row on the device."""
    n = len(rgbs)
    h, w = buffers.hw  # row sizes from the shape, not from indexing (a tensor op that may let the GIL go)
    rgb_row = h * w * 3  # bytes: uint8
    depth_row = h * w * 4  # float32
    plan = _row_copies(buffers.rgb.data_ptr(), rgb_row, [_address(rgb) for rgb in rgbs])
    plan += _row_copies(buffers.depth.data_ptr(), depth_row, [_address(depth) for depth in depths])
    plan.append(HostCopy(buffers.K.data_ptr(), ks.data_ptr(), n * _K_BYTES))
    plan.append(HostCopy(buffers.cam_from_centred.data_ptr(), starts.data_ptr(), n * _POSE_BYTES))
    if objects is not None:
        plan.append(HostCopy(buffers.row_object.data_ptr(), objects.data_ptr(), n * 8))  # int64 rows
    return plan


def _row_copies(dst0: int, row_bytes: int, sources: Sequence[int]) -> list[HostCopy]:
    """Copies filling rows ``0..len(sources)-1`` (``row_bytes`` each from ``dst0``) from host addresses: one from
    the host per distinct source, a device copy of the row that source filled first for each repeat."""
    first_row: dict[int, int] = {}
    plan = []
    for i, src in enumerate(sources):
        dst = dst0 + i * row_bytes
        filled = first_row.setdefault(src, dst)
        plan.append(HostCopy(dst, src, row_bytes) if filled == dst else HostCopy(dst, filled, row_bytes, True))
    return plan


def run_plan_on_host(plan: Sequence[HostCopy]) -> None:
    """Execute a plan whose addresses are all host memory (CPU buffers) with ``memmove``: how the CPU test checks the
    plan against the PyTorch copies."""
    for c in plan:
        ctypes.memmove(c.dst, c.src, c.nbytes)


def images_copyable(images: Sequence[Any], dtype: torch.dtype, np_dtype: type) -> bool:
    """Whether every image can be a copy source of the plan as it is: a C-contiguous CPU tensor of ``dtype`` (staged
    by its request: pinned) or a page-locked array of ``np_dtype`` (:func:`is_page_locked_array`)."""
    for image in images:
        if isinstance(image, Tensor):
            if image.dtype != dtype or image.device.type != "cpu" or not image.is_contiguous():
                return False
        elif not (isinstance(image, np.ndarray) and is_page_locked_array(image, np_dtype)):
            return False
    return True


class LaunchSlot:
    """Pinned K and start-pose staging and the results' landing place (``(rows, columns)`` float32 rows of the
    step's result block) for one submitted batch, with its event. ``busy`` from :meth:`LaunchSlots.take` until the
    batch is collected."""

    __slots__ = ("ks", "starts", "objects", "out", "ks_np", "starts_np", "objects_np", "out_np", "event", "busy")

    def __init__(self, rows: int, columns: int, event: int) -> None:
        self.ks = torch.empty((rows, 3, 3), dtype=torch.float64, pin_memory=True)
        self.starts = torch.empty((rows, 4, 4), dtype=torch.float32, pin_memory=True)
        self.objects = torch.zeros((rows,), dtype=torch.int64, pin_memory=True)  # row-object indices
        self.objects_np = self.objects.numpy()
        self.out = torch.empty((rows, columns), dtype=torch.float32, pin_memory=True)
        self.ks_np, self.starts_np, self.out_np = self.ks.numpy(), self.starts.numpy(), self.out.numpy()
        self.event = event
        self.busy = False

    def release(self) -> None:
        """Back to the ring: its batch was collected, or dropped uncollected (see ``TrackTicket``)."""
        self.busy = False


class LaunchSlots:
    """A ring of :class:`LaunchSlot` (made on first use). More batches in flight than slots: :meth:`take` returns
    None and the caller uses its PyTorch path for that batch."""

    def __init__(self, driver: CudaDriver, rows: int, columns: int, count: int = 8) -> None:
        self._driver, self._rows, self._columns, self._count = driver, rows, columns, count
        self._slots: list[LaunchSlot] = []
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> LaunchSlot | None:
        with self._lock:
            for _ in range(len(self._slots)):
                slot = self._slots[self._next]
                self._next = (self._next + 1) % len(self._slots)
                if not slot.busy:
                    slot.busy = True
                    return slot
            if len(self._slots) < self._count:
                slot = LaunchSlot(self._rows, self._columns, self._driver.new_event())
                slot.busy = True
                self._slots.append(slot)
                return slot
        return None


@dataclass(slots=True)
class DriverDone:
    """The completion of a driver-submitted batch: ``synchronize()`` waits (the GIL released) for its event."""

    driver: CudaDriver
    event: int

    def synchronize(self) -> None:
        self.driver.wait_event(self.event)


class DriverSubmit:
    """Enqueues a captured track batch on ``stream`` with driver calls (see the module docstring)."""

    def __init__(self, driver: CudaDriver, device: torch.device, stream: torch.cuda.Stream, max_rows: int,
                 result_columns: int) -> None:
        self.driver = driver
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = int(stream.cuda_stream)
        self.result_row_bytes = 4 * result_columns  # one float32 row of the step's result block
        self.slots = LaunchSlots(driver, max_rows, result_columns)
        self.launches = 0  # batches submitted this way

    def submit(self, buffers: Any, graph_exec: int, frames: Sequence[Any],
               row_object: np.ndarray | None = None) -> tuple[LaunchSlot, DriverDone] | None:
        """Stage K and start poses in a slot, enqueue the copies, one graph launch, the result rows' copy out
        (poses and judgements: one copy) and the event; None (nothing enqueued) when no slot is free. ``frames``: TrackFrame-likes whose images passed
        :func:`images_copyable`. row_object: (n,) int64 row-object indices of a step over several objects, staged
        and copied too (None: a single object's step, whose indices stay 0)."""
        self.driver.use_device(self.ordinal)  # a stage thread may never have made the context current
        slot = self.slots.take()  # (a new slot creates its event: after use_device)
        if slot is None:
            return None
        n = len(frames)
        for i, f in enumerate(frames):
            slot.ks_np[i] = f.K
            slot.starts_np[i] = f.start
        objects = None
        if row_object is not None:
            slot.objects_np[:n] = row_object
            objects = slot.objects
        plan = copy_plan(buffers, [f.rgb for f in frames], [f.depth for f in frames], slot.ks, slot.starts, objects)
        d, stream = self.driver, self.stream
        try:
            for c in plan:
                (d.copy_on_device if c.on_device else d.copy_to_device)(c.dst, c.src, c.nbytes, stream)
            d.launch_graph(graph_exec, stream)
            d.copy_to_host(slot.out.data_ptr(), buffers.result.data_ptr(), n * self.result_row_bytes, stream)
            d.record_event(slot.event, stream)
        except BaseException:
            slot.release()  # nothing of this batch will be collected
            raise
        self.launches += 1
        return slot, DriverDone(d, slot.event)


STACK_FROM = 2  # frames per batch from which stack_frames copies with one torch.stack per field (a lone frame: NumPy)


def stack_frames(frames: Sequence[Any], pinned: bool) -> tuple[Tensor | list[Tensor], Tensor | list[Tensor], Tensor, Tensor]:
    """Host tensors (n, ...) of the frames: rgb uint8, depth float32, K float64, start float32 (pinned on CUDA,
    from the caching host allocator, which keeps a block until its asynchronous copies are done).

    Two frames and more: one ``torch.stack(..., out=)`` per field, in C++ with the GIL released once per field (with
    many session threads validating, every reacquisition of the GIL can wait a whole switch interval). A lone frame:
    NumPy copies, as torch's CPU copy wakes its OpenMP threads, whose spinning afterwards slows a lone request
    (docs/benchmarks.md, "Host path"). Both paths copy the same bytes.
    Frames whose images their requests staged already (:meth:`TrackGraphRunner.host_images`): the images stay per frame (lists),
    only K and the start poses are stacked here.
    """
    n = len(frames)
    h, w = frames[0].depth.shape
    ks = torch.empty((n, 3, 3), dtype=torch.float64, pin_memory=pinned)
    starts = torch.empty((n, 4, 4), dtype=torch.float32, pin_memory=pinned)
    small = ((ks, "K", np.float64), (starts, "start", np.float32))
    if all(isinstance(f.rgb, Tensor) and isinstance(f.depth, Tensor) for f in frames):  # staged by their requests
        for out, field, _ in small:
            view = out.numpy()
            for i, f in enumerate(frames):
                view[i] = getattr(f, field)
        return [f.rgb for f in frames], [f.depth for f in frames], ks, starts  # type: ignore[return-value]
    rgb = torch.empty((n, h, w, 3), dtype=torch.uint8, pin_memory=pinned)
    depth = torch.empty((n, h, w), dtype=torch.float32, pin_memory=pinned)
    fields = ((rgb, "rgb", np.uint8), (depth, "depth", np.float32), *small)
    if n >= STACK_FROM:
        for out, field, dtype in fields:
            torch.stack([torch.from_numpy(np.asarray(getattr(f, field), dtype=dtype)) for f in frames], out=out)
    else:
        for out, field, _ in fields:
            view = out.numpy()
            for i, f in enumerate(frames):
                view[i] = getattr(f, field)
    return rgb, depth, ks, starts


def shared_rows(images: Sequence[Tensor]) -> tuple[list[int], list[tuple[int, int]]]:
    """The rows of ``images`` that cross to the device: the first row of each distinct host image (by address and
    size), and ``(row, earlier row)`` for each row reading an image an earlier row read."""
    first_row: dict[tuple[int, int], int] = {}
    firsts, repeats = [], []
    for i, image in enumerate(images):
        j = first_row.setdefault((image.data_ptr(), image.nbytes), i)
        if j == i:
            firsts.append(i)
        else:
            repeats.append((i, j))
    return firsts, repeats


def copy_rows(dst: list[Tensor], src: list[Tensor], *, non_blocking: bool) -> None:
    """``dst[i].copy_(src[i])`` for every i in one call (``torch._foreach_copy_``: the loop runs in C++ and the GIL
    is released and taken back once, not once per row: under 64 session threads each retake can wait a whole
    switch interval). :func:`copy_rows_reference` is the per-row loop it must equal."""
    torch._foreach_copy_(dst, src, non_blocking=non_blocking)


def copy_rows_reference(dst: list[Tensor], src: list[Tensor], *, non_blocking: bool) -> None:
    """The readable twin of :func:`copy_rows`: one ``copy_`` per row."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=non_blocking)


def copy_in(buffers: Any, staged: tuple[Tensor | list[Tensor], Tensor | list[Tensor], Tensor, Tensor], n: int,
             *, non_blocking: bool, row_object: np.ndarray | None = None) -> None:
    """Staged rows into the static buffers: stacked (n, ...) images in one copy each, or per-frame images (staged by
    their requests, :meth:`TrackGraphRunner.host_images`) in one copy per frame; with ``row_object`` ((n,) int64, a
    step over several objects) the row-object indices too (pinned staging when ``non_blocking``)."""
    rgb, depth, ks, starts = staged
    if isinstance(rgb, list):
        dst_rows = [*buffers.rgb[:n].unbind(0), *buffers.depth[:n].unbind(0)]
        src_rows = [*rgb, *depth]
        firsts, repeats = shared_rows(src_rows)
        copy_rows([dst_rows[i] for i in firsts], [src_rows[i] for i in firsts], non_blocking=non_blocking)
        if repeats:  # rows reading an image an earlier row read: copied from that row on the device
            copy_rows([dst_rows[i] for i, _ in repeats], [dst_rows[j] for _, j in repeats],
                      non_blocking=non_blocking)
    else:
        buffers.rgb[:n].copy_(rgb, non_blocking=non_blocking)
        buffers.depth[:n].copy_(depth, non_blocking=non_blocking)
    buffers.K[:n].copy_(ks, non_blocking=non_blocking)
    buffers.cam_from_centred[:n].copy_(starts, non_blocking=non_blocking)
    if row_object is not None:
        objects = torch.empty((n,), dtype=torch.int64, pin_memory=non_blocking)  # caching host allocator
        objects.numpy()[:] = row_object[:n]
        buffers.row_object[:n].copy_(objects, non_blocking=non_blocking)
