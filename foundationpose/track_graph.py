"""The track step, defined once: a batch of track requests on fixed buffers, run eagerly or as a CUDA graph.

:func:`track_step` is one track request batch on fixed buffers: depth filters and back-projection, then per
refine iteration crop windows, render, real-crop warps, normalisation, refiner forward and pose update (spec §1.3);
row i equals the plain per-iteration algorithm (:func:`foundationpose.refine.refine_iteration`) on frame i, bit for
bit on the CPU. Its rows may belong to different objects (an :class:`~foundationpose.object_group.ObjectGroup`: the
objects of one frame, several sessions): one render, one refiner forward per iteration and one pose update serve
every row, each row reading its object's mesh, diameter and validity model through the buffers' row-object
indices (device data); a single object is the group of one. It is the only track computation:
:meth:`foundationpose.estimator.PoseEstimator.run_track` and the service's track lane both run it through a
:class:`TrackGraphRunner`, which owns :class:`TrackBuffers` per (set of objects, padded batch
``B``, image size, iterations) and, on CUDA with a capturable renderer (the Triton rasteriser) and a torch
refiner, captures the step once per key as a ``torch.cuda.CUDAGraph``; intrinsics, poses and images are data in
the static buffers, not shapes. Everywhere else (CPU, nvdiffrast, ONNX/TensorRT cores, ``capture=False``) it runs
the same step eagerly on the same buffers, so the graph path and the eager path share one code path.

Capture rules the step keeps: no host synchronisation (no ``.item()``, ``.cpu()``, ``nonzero``, boolean
indexing, ``linalg.inv`` error checks, value-dependent Python branches); K lives on the device, so no constant is
built from host values during capture; constants that the caches build from host values (window offsets,
normalisation matrices, grids) are created by the warm-up runs, which run the step eagerly on the capture stream
before capture (cuDNN/cuBLAS/Triton lazy initialisation too). Allocations inside the capture come from one graph
memory pool shared by every graph of the runner, so replays are serialised on the runner's stream.

Capture failure never breaks a request: it is logged once with its traceback, the key is marked eager, and the
step runs eagerly on the same buffers from then on.

Padding: a batch of ``n`` requests runs at the smallest configured capacity ``B >= n``; rows ``n..B-1`` keep the
inputs of earlier requests (or the benign start values), are computed and ignored (rows are independent).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deploy_core.capture import StepRunner
from deploy_core.cuda_driver import load_driver
from deploy_core.errors import CapacityError
from deploy_core.infer import BaseInferCore
from deploy_core.memory import PinnedCopies
from foundationpose.crop import closed_form_inverse_on
from foundationpose.mesh import ObjectModel
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.network_inputs import DEFAULT_NETWORK_INPUT_IMPL
from foundationpose.object_group import GroupCache, ObjectGroup, judge_rows
from foundationpose.pose_update import apply_refiner_output
from foundationpose.refine import PairInputs, build_refiner_inputs_per_frame, run_refiner
from foundationpose.render import Renderer
from foundationpose.render._cache import GeometryConstants
from foundationpose.sampling import FilterImpl, bilateral_filter_depth, erode_depth
from foundationpose.sampling.backprojection import depth_to_xyz
from foundationpose.track_launch import (
    DriverDone,
    DriverSubmit,
    LaunchSlot,
    copy_in,
    images_copyable,
    stack_frames,
)
from foundationpose.validity import (
    JUDGED_COLUMNS,
    ValidityModels,
    ValidityTable,
    config_of,
)

__all__ = [
    "TRACK_STREAM_PRIORITY",
    "TrackBuffers",
    "TrackFrame",
    "TrackGraphConfig",
    "TrackGraphRunner",
    "TrackTicket",
    "capturable_renderer",
    "graph_batch_sizes",
    "renders_under_capture",
    "track_step",
]

# _stage only reads the frames (read-only views of request bodies included) through torch.from_numpy
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=r"foundationpose\.track_graph")

# torch stream priority of a track runner's stream (lower = higher; 0 = the default pool of every stage stream). A
# track batch is a few ms of small kernels that a waiting client needs now; a register is ~80 ms of large ones
# (REGISTER_STREAM_PRIORITY, one level lower). With tracks above registers, the GPU's block scheduler starts a track
# kernel's blocks before the register's next ones, so a register beside 64 track sessions delays them by a kernel.
TRACK_STREAM_PRIORITY = -2

_START_DEPTH_M = 0.5  # benign start values of the static inputs (padding rows before any request filled them)
_START_FOCAL_PX = 500.0


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Padded capacities for batches of up to ``max_batch`` requests: 1, 2, 3, 4, 6, 8, then steps of a quarter of
    the power of two below (10, 12, 14, 16, 20, 24, 28, 32, 40, ...), then ``max_batch`` itself. A batch of ``n``
    runs at the smallest capacity ``>= n``, its extra rows computed and ignored: at most one padded row up to 16,
    under a fifth of the rows above (powers of two padded 22% of the rows under load; docs/benchmarks.md)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b += 1 if b < 4 else max(2, (1 << (b.bit_length() - 1)) // 4)  # steps of 2 up to 16, then 4, 8, ...
    return (*sizes, max_batch)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackGraphConfig:
    """Sizing of the captured track steps.

    batch_sizes: padded capacities ``B`` (a batch of ``n`` runs at the smallest ``B >= n``); the largest is the
        most requests one replay takes. max_graphs: captured (set of objects, B, H, W, iterations) entries kept;
        the least recently used is dropped (with its buffers) beyond it, so a new image size costs one capture,
        not one per frame. capture: False runs the step eagerly on the buffers even on CUDA. max_groups: object
        groups (sets of objects that shared a batch) kept for new steps (:class:`~foundationpose.object_group.
        GroupCache`; an entry keeps its own).
    """

    batch_sizes: tuple[int, ...] = graph_batch_sizes(16)
    max_graphs: int = 128
    capture: bool = True
    max_groups: int = 64

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(int(b) < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be a non-empty tuple of ints >= 1, got {self.batch_sizes!r}")
        if tuple(sorted(set(self.batch_sizes))) != tuple(self.batch_sizes):
            raise ValueError(f"batch_sizes must be sorted and distinct, got {self.batch_sizes!r}")
        if self.max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {self.max_graphs}")
        if self.max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {self.max_groups}")


RESULT_COLUMNS = 16 + JUDGED_COLUMNS  # one row of a step's result: the refined pose (4 x 4), then its judged row


class TrackBuffers:
    """Static inputs and outputs of one captured step (all on the device).

    rgb: (B, H, W, 3) uint8 RGB.  depth: (B, H, W) float32 metres, 0 = invalid (raw: the step filters it).
    K: (B, 3, 3) float64 pixels.  cam_from_centred: (B, 4, 4) float32 start poses.
    row_object: (B,) int64 the object of each row (its index in the step's group; all 0 for a group of one), with
    its host copy ``row_object_host`` (the eager renderers that split a group's rows read it there).
    result: (B, RESULT_COLUMNS) float32 written by the step, copied out in one piece: ``out`` (B, 4, 4), the refined
    cam_from_centred, and ``judged`` (B, JUDGED_COLUMNS), the validity measurements, confidence and verdict
    (:mod:`foundationpose.validity`); both views of ``result``.
    """

    __slots__ = ("rgb", "depth", "K", "cam_from_centred", "row_object", "row_object_host", "result", "out", "judged",
                 "batch", "hw")

    def __init__(self, batch: int, hw: tuple[int, int], device: torch.device) -> None:
        h, w = hw
        self.batch, self.hw = int(batch), (int(h), int(w))
        self.rgb = torch.zeros((batch, h, w, 3), dtype=torch.uint8, device=device)
        self.depth = torch.full((batch, h, w), _START_DEPTH_M, dtype=torch.float32, device=device)
        k = torch.tensor(
            [[_START_FOCAL_PX, 0.0, w / 2], [0.0, _START_FOCAL_PX, h / 2], [0.0, 0.0, 1.0]], dtype=torch.float64
        )
        self.K = k.expand(batch, 3, 3).contiguous().to(device)
        pose = torch.eye(4, dtype=torch.float32)
        pose[2, 3] = _START_DEPTH_M
        self.cam_from_centred = pose.expand(batch, 4, 4).contiguous().to(device)
        self.row_object = torch.zeros((batch,), dtype=torch.int64, device=device)
        self.row_object_host = np.zeros((batch,), dtype=np.int64)
        self.result = torch.zeros((batch, RESULT_COLUMNS), dtype=torch.float32, device=device)
        self.out = self.result[:, :16].view(batch, 4, 4)
        self.judged = self.result[:, 16:]


def track_step(
    buffers: TrackBuffers,
    group: ObjectGroup,
    renderer: Renderer,
    forward: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    *,
    iterations: int,
    crop_size: int,
    constants: GeometryConstants,
    depth_filter_impl: FilterImpl = "auto",
    network_input_impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
    validity: ValidityTable | None = None,
) -> None:
    """One track batch on ``buffers`` (the function that is captured): writes ``buffers.out`` and, with
    ``validity`` (the group's table of each object's points and thresholds, :meth:`ObjectGroup.validity
    <foundationpose.object_group.ObjectGroup.validity>`), ``buffers.judged``: ONE pass of
    :func:`foundationpose.validity.measure_validity_rows` and :func:`~foundationpose.validity.judge_validity` over
    every row, each with its own object's table rows (:func:`foundationpose.object_group.judge_rows`), of each
    refined pose on the step's filtered depth and, for its appearance, the last iteration's network inputs; without
    it the judged rows stay zero: not valid.

    group: the objects of the rows; row i is object ``buffers.row_object[i]`` of it (its mesh in the one render, its
    diameter in the crops, normalisation and update, its validity points and thresholds).
    Row i equals ``PoseEstimator.run_track`` of frame i with row i's object (its filters, crops, render, warps,
    refiner, update), bit for bit on the CPU. forward: ``(render_input, transf_input) -> (trans, rot)``, (B, 3) each.
    constants: the owner's crop constants (filled by a warm-up run; a capture must find every entry there).
    The warps' window inverse is the closed form on CUDA (``affine_inverse``: LU factorisations may not be capturable;
    an ulp apart from the LU's, the poses stay within the fp16 tolerance) and the LU elsewhere
    (:func:`foundationpose.crop.closed_form_inverse_on`: bit for bit on the CPU).
    """
    impl = depth_filter_impl
    # every constant comes from the owner's cache (a capture may not copy host values to the device)
    eroded = erode_depth(buffers.depth, impl=impl, constants=constants)
    depth_f = bilateral_filter_depth(eroded, impl=impl, constants=constants)  # (B, H, W) float32
    xyz_cam = depth_to_xyz(depth_f, buffers.K, constants=constants)  # (B, H, W, 3) float32, per-row K on the device
    rgb = buffers.rgb.to(torch.float32)  # (B, H, W, 3) 0..255
    poses = buffers.cam_from_centred
    closed_form = closed_form_inverse_on(poses.device)
    rows = group.rows(buffers.row_object, buffers.row_object_host)  # per-row diameters and meshes, gathered once
    for _ in range(iterations):
        inputs = build_refiner_inputs_per_frame(
            poses, rgb, xyz_cam, buffers.K, rows, renderer, crop_size=crop_size, constants=constants,
            affine_inverse=closed_form, impl=network_input_impl,
        )
        trans, rot = forward(inputs.render_input, inputs.transf_input)
        poses = apply_refiner_output(poses, trans.float(), rot.float(), rows.diameter)
    buffers.out.copy_(poses)
    if validity is not None:
        buffers.judged.copy_(judge_rows(depth_f, buffers.K, buffers.cam_from_centred, poses,
                                        validity.rows(buffers.row_object),
                                        appearance=(inputs.render_input, inputs.transf_input)))


def renders_under_capture(renderer: Renderer) -> bool:
    """Whether ``renderer``'s backend can be captured in a CUDA graph: the Triton rasteriser on CUDA (nvdiffrast
    crashes under capture; the CPU rasteriser syncs)."""
    return renderer.name == "triton" and renderer.device.type == "cuda"


def capturable_renderer(renderer: Renderer) -> Renderer | None:
    """A renderer for captured steps built like ``renderer`` (same config), or None when its backend cannot be
    captured (:func:`renders_under_capture`). The Triton rasteriser is rebuilt to enqueue on the caller's stream
    (no fork/join, scratch of its own)."""
    if not renders_under_capture(renderer):
        return None
    from foundationpose.render.triton_raster import TritonRasterizer

    return TritonRasterizer(renderer.device, renderer.config, use_caller_stream=True)


def _refiner_forward(refiner: BaseInferCore) -> tuple[Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], bool]:
    """``(forward, capturable)``: the torch core's eager capturable forward, else ``run_refiner`` (not capturable)."""
    capturable = getattr(refiner, "capturable_forward", None)
    if capturable is not None:
        return (lambda a, b: tuple(capturable(a, b))), True  # type: ignore[return-value]

    def eager(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return run_refiner(refiner, PairInputs(render_input=a, transf_input=b, crop_from_img=None))  # type: ignore[arg-type]

    return eager, False


class _Entry:
    __slots__ = ("group", "buffers", "graph", "iterations", "graph_exec")

    def __init__(self, group: ObjectGroup, buffers: TrackBuffers, iterations: int) -> None:
        self.group = group  # held: the key's object ids stay unique while the entry lives
        self.buffers = buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.iterations = iterations
        self.graph_exec: int | None = None  # the graph's cudaGraphExec_t, for driver launches (read once)


@dataclass(frozen=True, slots=True)
class TrackFrame:
    """One track request for the runner: rgb (H, W, 3) uint8, depth (H, W) float32 metres, K (3, 3) pixels,
    start (4, 4) float32 cam_from_centred. Already validated (:mod:`foundationpose.validate`). rgb and depth are
    NumPy arrays, or host tensors from :meth:`TrackGraphRunner.host_images` (staged by the request's own thread)."""

    rgb: np.ndarray | Tensor
    depth: np.ndarray | Tensor
    K: np.ndarray
    start: np.ndarray


def _copyable(frames: Sequence[TrackFrame]) -> bool:
    """Whether every frame's images can be copied to the GPU from where they are (a driver launch's condition)."""
    return (images_copyable([f.rgb for f in frames], torch.uint8, np.uint8)
            and images_copyable([f.depth for f in frames], torch.float32, np.float32))


@dataclass(slots=True, weakref_slot=True)
class TrackTicket:
    """A submitted batch: ``host`` (n, RESULT_COLUMNS) float32 rows (pinned on CUDA) become valid once ``done`` completes
    (``done.synchronize()``). slot: the driver launch's staging; ``release`` gives it back, once: at collect, or when
    a ticket nobody collects is dropped (a batch failed or dropped at the lane's finish boundary), so the ring
    never leaks slots. Reuse after a drop is safe: the next batch's copies queue behind this one's on the runner's
    one stream. keep: the staged frames, held until collect because their copies may still be pending."""

    n: int
    host: np.ndarray
    done: torch.cuda.Event | DriverDone | None
    replayed: bool
    slot: LaunchSlot | None = None
    keep: Any = None
    release: Callable[[], Any] | None = None


def _slot_ticket(n: int, slot: Any, done: Any, frames: Any) -> TrackTicket:
    """The ticket of a driver-launched batch: its result rows land in ``slot.out_np``; ``slot.release()`` runs once, through
    ``ticket.release``, which collect calls and a dropped ticket's finaliser calls (whichever comes first)."""
    ticket = TrackTicket(n=n, host=slot.out_np[:n], done=done, replayed=True, slot=slot, keep=frames)
    ticket.release = weakref.finalize(ticket, slot.release)
    return ticket


class TrackGraphRunner(StepRunner):
    """Captured (or eager) track steps for one refiner and renderer on one device; see the module docstring.

    refiner: the track refiner core (``PoseNetworks.track_refiner``). renderer: the estimator's renderer; on CUDA
    a capturable copy is made (:func:`capturable_renderer`) when it is the Triton backend, else the step runs
    eagerly with ``renderer`` itself. Thread safety: :meth:`submit` and :meth:`collect` may be called from
    different threads; submissions are serialised (one stream, one memory pool). Captured batches whose images are
    staged (:meth:`host_images`, or a page-locked ring) are submitted with CUDA driver calls that keep the GIL
    (:mod:`foundationpose.track_launch`) where the driver library loads; the rest through PyTorch (the same copies
    and replay).
    """

    def __init__(
        self,
        refiner: BaseInferCore,
        renderer: Renderer,
        device: torch.device | str,
        *,
        crop_size: int = CROP_SIZE,
        config: TrackGraphConfig = TrackGraphConfig(),
        constants: GeometryConstants | None = None,
        depth_filter_impl: FilterImpl = "auto",
        network_input_impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
    ) -> None:
        self.device = torch.device(device)
        # crop constants that the warm-up fills before capture (the estimator's own, or the runner's)
        self.constants = constants if constants is not None else GeometryConstants(name="track-graph")
        self.depth_filter_impl = depth_filter_impl
        self.network_input_impl = network_input_impl
        self.config = config
        self.crop_size = crop_size
        if config.batch_sizes[-1] > refiner.max_batch:
            raise ValueError(
                f"batch_sizes up to {config.batch_sizes[-1]} exceed the refiner's max_batch {refiner.max_batch}"
            )
        self._forward, _ = _refiner_forward(refiner)
        cuda = self.device.type == "cuda"
        graph_renderer = capturable_renderer(renderer) if cuda else None
        self.renderer = graph_renderer or renderer
        self.capturable = bool(config.capture and cuda and self.can_capture(refiner, renderer))
        self._init_steps(self.device, capturable=self.capturable, max_entries=config.max_graphs, name="track",
                         priority=TRACK_STREAM_PRIORITY)
        self._driver_submit: DriverSubmit | None = None
        self.rows_requested = 0  # frames submitted so far
        self.rows_padding = 0  # rows computed beyond them (a batch of n runs at its padded capacity B >= n)
        self.steps_run = 0  # steps submitted so far (one per batch, whatever its objects)
        self._copies = PinnedCopies(pinned=cuda)
        self._validity = ValidityModels(self.device)  # each object's points for the step's validity
        self._groups = GroupCache(self.device, config.max_groups)  # the sets of objects batches brought
        if self.capturable and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
            driver = load_driver()
            if driver is not None:
                assert self._stream is not None
                self._driver_submit = DriverSubmit(driver, self.device, self._stream, self.max_batch, RESULT_COLUMNS)

    @staticmethod
    def can_capture(refiner: BaseInferCore, renderer: Renderer) -> bool:
        """Whether track steps with this refiner core and renderer can be captured (a torch core's capturable
        forward, :func:`renders_under_capture`)."""
        return hasattr(refiner, "capturable_forward") and renders_under_capture(renderer)

    @staticmethod
    def captures_steps(backend: str, renderer: Renderer) -> bool:
        """Whether steps are captured with networks of ``backend`` and ``renderer`` (before the networks exist: the
        torch backend's cores have capturable forwards)."""
        return backend == "torch" and renders_under_capture(renderer)

    def host_images(self, rgb: np.ndarray, depth: np.ndarray) -> tuple[Tensor, Tensor]:
        """One frame's images as host tensors this runner copies in as they are (:class:`PinnedCopies`: page-locked
        on CUDA, zero-copy views on the CPU). Call it in the request's own thread: a batch's staging is then spread
        over its requests' threads instead of one thread copying every frame (NumPy releases the GIL for the copy).
        """
        rgb_h, depth_h = self._copies.of(rgb, depth)
        return rgb_h, depth_h

    # -- sizing -----------------------------------------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self.config.batch_sizes[-1]

    @property
    def driver_launches(self) -> int:
        """Batches submitted with driver calls so far (:mod:`foundationpose.track_launch`); the rest used PyTorch."""
        return self._driver_submit.launches if self._driver_submit is not None else 0

    def padded_batch(self, n: int) -> int:
        """The capacity a batch of ``n`` requests runs at. Raises CapacityError above the largest."""
        for b in self.config.batch_sizes:
            if n <= b:
                return b
        raise CapacityError(f"track batch: expected at most {self.max_batch} requests per step; got {n}")

    def prepare(self, obj: ObjectModel | Sequence[ObjectModel], hw: tuple[int, int], iterations: int) -> int:
        """Build the step of every batch size for ``obj`` (or the group of several objects: its steps then serve
        any batch mixing them, as supersets do in :class:`~foundationpose.object_group.GroupCache`) at image size
        ``hw`` now (captured on CUDA), so that no request pays for a capture later (each costs two eager warm-up
        steps and the capture, tens of ms, with every other submit waiting). Returns how many entries were new.
        Raises ValueError when the batch sizes outnumber ``max_graphs`` (the first ones would be dropped again at
        once) or for more than :data:`~foundationpose.object_group.MAX_GROUP_OBJECTS` objects."""
        sizes = self.config.batch_sizes
        if len(sizes) > self.config.max_graphs:
            raise ValueError(f"prepare: {len(sizes)} batch sizes {sizes} exceed max_graphs={self.config.max_graphs}")
        hw = (int(hw[0]), int(hw[1]))
        objects = _objects(obj, None)
        new = 0
        for b in sizes:  # the lock per size: a request submitted meanwhile waits for one capture, not for all
            with self._lock:
                group = self._groups.of(objects)
                new += _key(group, b, hw, iterations) not in self._steps
                self._entry(group, b, hw, iterations)
        return new

    def time_steps(self, obj: ObjectModel | Sequence[ObjectModel], hw: tuple[int, int], iterations: int,
                   repeats: int = 10) -> dict[int, dict]:
        """Time one step (replay, or the eager step) of every batch size for ``obj`` (or the group of several
        objects, as :meth:`prepare`) on the static buffers as they are (built
        by :meth:`prepare` first if missing): ``{B: {"gpu_ms", "wall_ms", "gpu_ms_per_frame"}}``, medians of
        ``repeats``. GPU time from CUDA events around the launch on the runner's stream (None on the CPU); wall time
        is the host's launch call alone (how long the host is busy per batch). For the bench: it answers whether a
        batch size is GPU- or host-bound. Not for serving (it holds the lock and synchronises)."""
        hw = (int(hw[0]), int(hw[1]))
        objects = _objects(obj, None)
        out: dict[int, dict] = {}
        for b in self.config.batch_sizes:
            with self._lock, torch.no_grad():
                entry = self._entry(self._groups.of(objects), b, hw, iterations)
                runs = [self._timed_launch(entry) for _ in range(max(1, repeats))]
            gpu = [g for g, _ in runs if g is not None]
            wall = [w for _, w in runs]
            gpu_ms = float(np.median(gpu)) if gpu else None
            out[b] = {"gpu_ms": None if gpu_ms is None else round(gpu_ms, 3), "wall_ms": round(float(np.median(wall)), 3),
                      "gpu_ms_per_frame": None if gpu_ms is None else round(gpu_ms / b, 4)}
        return out

    # -- requests ---------------------------------------------------------------------------------------------------

    def run(self, obj: ObjectModel | Sequence[ObjectModel], frames: Sequence[TrackFrame],
            iterations: int) -> tuple[np.ndarray, np.ndarray]:
        """Refine each frame's start pose for ``iterations`` steps; returns (n, 4, 4) float32 cam_from_centred and
        (n, JUDGED_COLUMNS) float32 judged rows (:func:`foundationpose.validity.judgement_of_row`). obj: the object
        of every frame, or one object per frame (:meth:`submit`)."""
        return self.collect(self.submit(obj, frames, iterations))

    def submit(self, obj: ObjectModel | Sequence[ObjectModel], frames: Sequence[TrackFrame],
               iterations: int) -> TrackTicket:
        """Copy the frames in (pinned staging -> static buffers), replay (or run the step), copy the poses out;
        everything enqueued on the runner's stream without waiting for the GPU. All frames share one image size.
        obj: the object of every frame, or a sequence of one object per frame: the frames of several objects run
        as ONE step over the group of those objects (one render, one refiner forward per iteration; the step's
        key is the set of objects, so any mix of the same objects replays the same graph).
        Raises CapacityError above :attr:`max_batch`, ValueError for mixed sizes, no frames or a per-frame
        object list of another length."""
        n = len(frames)
        if n == 0:
            raise ValueError("frames: expected at least one track request; got none")
        objects = _objects(obj, n)
        hw = tuple(frames[0].depth.shape)
        for i, f in enumerate(frames):
            if tuple(f.depth.shape) != hw or tuple(f.rgb.shape) != (*hw, 3):
                raise ValueError(
                    f"frames[{i}]: expected rgb {(*hw, 3)} and depth {hw} like frames[0]; "
                    f"got {tuple(f.rgb.shape)} and {tuple(f.depth.shape)}"
                )
        batch = self.padded_batch(n)
        with self._lock:
            group = self._groups.of(objects)
            entry = self._entry(group, batch, hw, iterations)  # type: ignore[arg-type]
            # row-object indices: a group of one keeps its zeros (padding rows keep earlier, valid indices)
            row_object = group.index_of(objects) if len(group) > 1 else None
            if row_object is not None:
                entry.buffers.row_object_host[:n] = row_object
            self.rows_requested += n
            self.rows_padding += batch - n
            self.steps_run += 1
            if self._driver_submit is not None and entry.graph is not None and _copyable(frames):
                if entry.graph_exec is None:
                    entry.graph_exec = int(entry.graph.raw_cuda_graph_exec())
                launched = self._driver_submit.submit(entry.buffers, entry.graph_exec, frames, row_object)
                if launched is not None:  # else every slot is in flight: PyTorch below
                    slot, done = launched
                    return _slot_ticket(n, slot, done, frames)
            staged = stack_frames(frames, self._stream is not None)  # images stay per frame when already staged
            if self._stream is None:  # CPU: the same step, inline
                copy_in(entry.buffers, staged, n, non_blocking=False, row_object=row_object)
                self._step(entry)
                return TrackTicket(n=n, host=entry.buffers.result[:n].clone().numpy(), done=None, replayed=False)
            with torch.cuda.device(self.device):
                self._stream.wait_stream(torch.cuda.current_stream(self.device))  # caller's prior work (meshes)
                with torch.cuda.stream(self._stream):
                    copy_in(entry.buffers, staged, n, non_blocking=True, row_object=row_object)
                    replayed = self._launch(entry)
                    host = torch.empty((n, RESULT_COLUMNS), dtype=torch.float32, pin_memory=True)
                    host.copy_(entry.buffers.result[:n], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._stream)
            return TrackTicket(n=n, host=host.numpy(), done=done, replayed=replayed)

    @staticmethod
    def collect(ticket: TrackTicket) -> tuple[np.ndarray, np.ndarray]:
        """Wait for a submitted batch (its one event): its (n, 4, 4) float32 poses and (n, JUDGED_COLUMNS) judged
        rows."""
        if ticket.done is not None:
            ticket.done.synchronize()
        rows = ticket.host.copy()
        poses, judged = rows[:, :16].reshape(-1, 4, 4), rows[:, 16:]
        if ticket.release is not None:  # its pinned staging may be reused now
            ticket.release()
            ticket.release = None
        ticket.slot = ticket.keep = None
        return poses, judged

    def forget(self, obj: ObjectModel) -> int:  # type: ignore[override]
        """Drop every step whose group holds ``obj`` (graphs and buffers: its own and those of the groups it was
        tracked in with other objects), and those groups; returns how many steps. Pending replays finish first."""
        with self._lock:
            self._groups.forget(obj)
        return self.forget_where(lambda e: any(o is obj for o in e.group.objects), obj)

    # -- capture ----------------------------------------------------------------------------------------------------

    def _entry(self, group: ObjectGroup, batch: int, hw: tuple[int, int], iterations: int) -> _Entry:
        group.validity(self._validity.of, config_of)  # the group's table, built here: never inside a capture
        return self._steps.get(_key(group, batch, hw, iterations),
                               lambda: _Entry(group, TrackBuffers(batch, hw, self.device), int(iterations)), self._step)

    def _step(self, entry: _Entry) -> None:
        with torch.no_grad():
            track_step(
                entry.buffers, entry.group, self.renderer, self._forward,
                iterations=entry.iterations, crop_size=self.crop_size, constants=self.constants,
                depth_filter_impl=self.depth_filter_impl, network_input_impl=self.network_input_impl,
                validity=entry.group.validity(self._validity.of, config_of),
            )


def _objects(obj: ObjectModel | Sequence[ObjectModel], n: int | None) -> list[ObjectModel]:
    """One object per frame (``n`` frames; None: as given) from an object or a per-frame sequence."""
    if isinstance(obj, ObjectModel):
        return [obj] * (1 if n is None else n)
    objects = list(obj)
    if not objects or (n is not None and len(objects) != n):
        raise ValueError(f"obj: expected one object or {n} objects (one per frame); got {len(objects)}")
    return objects


def _key(group: ObjectGroup, batch: int, hw: tuple[int, int], iterations: int) -> tuple:
    """The cache key of one captured step: (the group's set of object ids, B, H, W, iterations)."""
    return (group.key, batch, int(hw[0]), int(hw[1]), int(iterations))
