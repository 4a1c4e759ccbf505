"""A register's refine iterations and scorer as one CUDA graph: copy in, one replay, one event, copy out.

:func:`register_step` is the GPU part of one register after its hypotheses exist: every refine iteration (crop
windows, render, real-crop warps, network inputs, refiner, pose update) over the N hypotheses of one frame, then
the scorer's pairs, the scorer and the pick (``argmax``: ties to the lowest index, spec §5) — the functions
:meth:`foundationpose.estimator.PoseEstimator.register_candidates` calls, in the same order, on fixed buffers.
:class:`RegisterGraphRunner` owns :class:`RegisterBuffers` per (object, hypotheses ``N``, image size, iterations)
and, on CUDA with a capturable renderer (the Triton rasteriser) and torch networks, captures the step once per key;
the frame, K and the hypotheses are data in the static buffers, not shapes. Everywhere else (CPU, nvdiffrast,
ONNX/TensorRT cores) the same step runs eagerly on the same buffers.

Why: an eager register launches ~600 kernels from Python (profile of 3 registers, H200), plus the compiled networks'
own. Alone that cost ~9 ms of a 96 ms register (86.9 ms captured, same call); beside a loaded track lane every
launch waits for the GIL, and registers were answered at 1.6/s beside 64 track clients (8.0/s captured, with 4 in
flight). A replay is one launch.

What stays eager, before the replay: upload, depth filters and back-projection, the hypotheses (translation guess
from the mask) and the masked-depth count, a few dozen launches. Capture rules are those of
:mod:`foundationpose.track_graph`: no host synchronisation in the step; K lives on the device ((3, 3) float64,
expanded to (N, 3, 3) rows for the windows and the renderer, which then never read it back); the window inverses
are the closed form on CUDA (``affine_inverse``: possibly an ulp apart from the LU's, so captured registers agree
with eager ones within the fp16 tolerance) and the LU on the CPU, bit for bit
(:func:`foundationpose.crop.closed_form_inverse_on`); constants, renderer
scratch, cuDNN/cuBLAS and inductor code are made by two eager warm-up runs on the capture stream first.

Every graph of a runner shares one memory pool and one stream: replays run one after another, and the copy-in of
the next register is ordered after the previous replay on that stream, so one set of static buffers per key is
enough for any number of registers in flight (the GPU is the register's bottleneck; the host work of the next
frame still overlaps the replay). Capture failure never fails a request: it is logged once with its traceback and
that key runs eagerly from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deploy_core.capture import StepRunner
from deploy_core.infer import BaseInferCore
from foundationpose.crop import closed_form_inverse_on
from foundationpose.mesh import ObjectModel
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.network_inputs import DEFAULT_NETWORK_INPUT_IMPL
from foundationpose.observation import PreparedFrame
from foundationpose.pose_update import apply_refiner_output
from foundationpose.refine import PairInputs, build_refiner_inputs, run_refiner
from foundationpose.render import Renderer
from foundationpose.render._cache import GeometryConstants
from foundationpose.sampling import FilterImpl
from foundationpose.score import build_scorer_inputs, run_scorer
from foundationpose.track_graph import TRACK_STREAM_PRIORITY, capturable_renderer, renders_under_capture

__all__ = [
    "RegisterBuffers",
    "RegisterGraphConfig",
    "RegisterGraphRunner",
    "RegisterTicket",
    "register_step",
]


REGISTER_STREAM_PRIORITY = TRACK_STREAM_PRIORITY + 1  # below the track runners' (foundationpose.track_graph)

_START_DEPTH_M = 0.5  # benign start values of the static inputs (before any register filled them)
_START_FOCAL_PX = 500.0

Forward = Callable[[Tensor, Tensor], tuple[Tensor, ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterGraphConfig:
    """Sizing of the captured register steps.

    max_graphs: captured (object, N, H, W, iterations) entries kept; the least recently used is dropped (with its
        buffers) beyond it and captured again when needed (~3 registers' time). The graphs share one memory pool
        (their replays never overlap), so an entry adds its static buffers (one frame, N poses), not a second set of
        activations. capture: False runs the step eagerly on the buffers even on CUDA.
    """

    max_graphs: int = 8
    capture: bool = True

    def __post_init__(self) -> None:
        if self.max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {self.max_graphs}")


class RegisterBuffers:
    """Static inputs and outputs of one captured register step (all on the device).

    rgb: (H, W, 3) float32 0..255.  depth: (H, W) float32 metres, filtered.  xyz: (H, W, 3) float32 camera-frame
    points of ``depth``.  K: (3, 3) float64 pixels.  poses: (N, 4, 4) float32 hypotheses (cam_from_centred).
    out_poses: (N, 4, 4) float32 refined hypotheses.  scores: (N,) float32 scorer logits.  best: () int64 index of
    the highest score.
    """

    __slots__ = ("rgb", "depth", "xyz", "K", "poses", "out_poses", "scores", "best", "n", "hw")

    def __init__(self, n: int, hw: tuple[int, int], device: torch.device) -> None:
        h, w = hw
        self.n, self.hw = int(n), (int(h), int(w))
        self.rgb = torch.zeros((h, w, 3), dtype=torch.float32, device=device)
        self.depth = torch.full((h, w), _START_DEPTH_M, dtype=torch.float32, device=device)
        self.xyz = torch.zeros((h, w, 3), dtype=torch.float32, device=device)
        self.xyz[..., 2] = _START_DEPTH_M
        k = torch.tensor([[_START_FOCAL_PX, 0.0, w / 2], [0.0, _START_FOCAL_PX, h / 2], [0.0, 0.0, 1.0]],
                         dtype=torch.float64)
        self.K = k.to(device)
        pose = torch.eye(4, dtype=torch.float32)
        pose[2, 3] = _START_DEPTH_M
        self.poses = pose.expand(n, 4, 4).contiguous().to(device)
        self.out_poses = torch.zeros((n, 4, 4), dtype=torch.float32, device=device)
        self.scores = torch.zeros((n,), dtype=torch.float32, device=device)
        self.best = torch.zeros((), dtype=torch.int64, device=device)

    def frame(self) -> PreparedFrame:
        """The static frame as the refine and score builders take it (K on the device)."""
        return PreparedFrame(rgb=self.rgb, depth=self.depth, xyz_cam=self.xyz, K=self.K)  # type: ignore[arg-type]


def register_step(
    buffers: RegisterBuffers,
    obj: ObjectModel,
    renderer: Renderer,
    refine: Forward,
    score: Forward,
    *,
    iterations: int,
    crop_size: int,
    constants: GeometryConstants,
    network_input_impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
) -> None:
    """Refine ``buffers.poses`` for ``iterations`` steps, score them and pick the best (the function captured):
    writes ``out_poses``, ``scores`` and ``best``. refine / score: ``(render_input, transf_input) -> outputs``
    (the cores' capturable forwards, or their chunked ``infer`` where nothing is captured)."""
    frame = buffers.frame()
    k_rows = buffers.K.expand(buffers.n, 3, 3)  # device rows: the windows and the renderer never read K back
    poses = buffers.poses
    closed_form = closed_form_inverse_on(poses.device)
    for _ in range(iterations):
        inputs = build_refiner_inputs(
            poses, frame, obj, renderer, crop_size=crop_size, constants=constants, impl=network_input_impl,
            hypothesis_K=k_rows, affine_inverse=closed_form,
        )
        trans, rot = refine(inputs.render_input, inputs.transf_input)
        poses = apply_refiner_output(poses, trans.float(), rot.float(), obj.diameter)
    inputs = build_scorer_inputs(
        poses, frame, obj, renderer, crop_size=crop_size, constants=constants, impl=network_input_impl,
        hypothesis_K=k_rows, affine_inverse=closed_form,
    )
    (scores,) = score(inputs.render_input, inputs.transf_input)
    scores = scores.float().reshape(buffers.n)
    buffers.out_poses.copy_(poses)
    buffers.scores.copy_(scores)
    buffers.best.copy_(torch.argmax(scores))  # first maximum: ties go to the lowest index (spec §5)


def _forwards(refiner: BaseInferCore, scorer: BaseInferCore, n: int) -> tuple[Forward, Forward, bool]:
    """``(refine, score, capturable)`` for N hypotheses: the torch cores' capturable forwards (the refiner in chunks
    of its ``max_batch``, as :func:`foundationpose.refine.run_refiner`), else their ``infer`` (not capturable)."""
    refine_c = getattr(refiner, "capturable_forward", None)
    score_c = getattr(scorer, "capturable_forward", None)
    if refine_c is not None and score_c is not None:
        step = max(1, min(n, refiner.max_batch))

        def refine(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
            parts = [refine_c(a[i : i + step], b[i : i + step]) for i in range(0, n, step)]
            if len(parts) == 1:
                return parts[0][0], parts[0][1]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        return refine, (lambda a, b: tuple(score_c(a, b))), True

    def refine_eager(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return run_refiner(refiner, PairInputs(render_input=a, transf_input=b, crop_from_img=None))  # type: ignore[arg-type]

    def score_eager(a: Tensor, b: Tensor) -> tuple[Tensor]:
        return (run_scorer(scorer, PairInputs(render_input=a, transf_input=b, crop_from_img=None)),)  # type: ignore[arg-type]

    return refine_eager, score_eager, False


class _Entry:
    __slots__ = ("obj", "buffers", "graph", "iterations", "refine", "score")

    def __init__(self, obj: ObjectModel, buffers: RegisterBuffers, iterations: int, refine: Forward,
                 score: Forward) -> None:
        self.obj = obj  # held: the key's id(obj) stays unique while the entry lives
        self.buffers = buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.iterations = iterations
        self.refine, self.score = refine, score


@dataclass(slots=True)
class RegisterTicket:
    """A submitted register: ``host`` (pinned on CUDA) holds the best pose (rows 0-3 of a (5, 4) float32 block,
    row 4 = [score, index, 0, 0]) once ``done`` completes. ``poses`` / ``scores``: device copies of every refined
    hypothesis and score (only when submitted with ``keep_all``), valid once ``done`` completes."""

    host: Tensor
    done: torch.cuda.Event | None
    replayed: bool
    poses: Tensor | None = None
    scores: Tensor | None = None


class RegisterGraphRunner(StepRunner):
    """Captured (or eager) register steps for one refiner, scorer and renderer on one device; see the module
    docstring. Thread safety: :meth:`submit` and :meth:`collect` may be called from different threads; submissions
    are serialised (one stream, one memory pool)."""

    def __init__(
        self,
        refiner: BaseInferCore,
        scorer: BaseInferCore,
        renderer: Renderer,
        device: torch.device | str,
        *,
        crop_size: int = CROP_SIZE,
        config: RegisterGraphConfig = RegisterGraphConfig(),
        capture: bool = True,
        constants: GeometryConstants | None = None,
        network_input_impl: FilterImpl = DEFAULT_NETWORK_INPUT_IMPL,
    ) -> None:
        self.device = torch.device(device)
        self.refiner, self.scorer = refiner, scorer
        self.config = config if capture else RegisterGraphConfig(max_graphs=config.max_graphs, capture=False)
        self.crop_size = crop_size
        self.constants = constants if constants is not None else GeometryConstants(name="register-graph")
        self.network_input_impl = network_input_impl
        cuda = self.device.type == "cuda"
        graph_renderer = capturable_renderer(renderer) if cuda else None
        self.renderer = graph_renderer or renderer
        self.capturable = bool(self.config.capture and cuda and self.can_capture(refiner, scorer, renderer))
        # a stream of the runners' own pool: a capture then records no other thread's work (a default-priority stream
        # may be a lane stage's); its replays rank below the track runners'
        self._init_steps(self.device, capturable=self.capturable, max_entries=config.max_graphs, name="register",
                         priority=REGISTER_STREAM_PRIORITY)

    @staticmethod
    def can_capture(refiner: BaseInferCore, scorer: BaseInferCore, renderer: Renderer) -> bool:
        """Whether registers with these cores and renderer can be captured (the torch cores' capturable forwards,
        :func:`foundationpose.track_graph.renders_under_capture`)."""
        return (all(hasattr(core, "capturable_forward") for core in (refiner, scorer))
                and renders_under_capture(renderer))

    def prepare(self, obj: ObjectModel, n: int, hw: tuple[int, int], iterations: int) -> bool:
        """Build (and on CUDA capture) the step for ``obj``, ``n`` hypotheses, image size ``hw`` and ``iterations``
        now instead of on the first register. Returns whether it was new."""
        with self._lock:
            new = _key(obj, n, hw, iterations) not in self._steps
            self._entry(obj, n, hw, iterations)
        return new

    def time_step(self, obj: ObjectModel, frame: PreparedFrame, poses: Tensor, iterations: int,
                  repeats: int = 5) -> dict[str, float | None]:
        """Time one step (replay, or the eager step) on the static buffers after copying ``frame`` and ``poses`` in:
        ``{"gpu_ms", "wall_ms"}``, medians of ``repeats``. GPU time from CUDA events around the launch on the
        runner's stream (None on the CPU); wall time is the host's launch call alone. For the bench: a captured
        register's stages run on the runner's stream, which the lane's per-stage GPU times do not see. Not for
        serving (it holds the lock and synchronises)."""
        with self._lock, torch.no_grad():
            entry = self._entry(obj, int(poses.shape[0]), frame.hw, iterations)
            runs = [self._timed_launch(entry, lambda: _copy_in(entry.buffers, frame, poses))
                    for _ in range(max(1, repeats))]
        gpu = [g for g, _ in runs if g is not None]
        wall = [w for _, w in runs]
        return {"gpu_ms": round(float(np.median(gpu)), 3) if gpu else None,
                "wall_ms": round(float(np.median(wall)), 3)}

    # -- requests ---------------------------------------------------------------------------------------------------

    def submit(self, obj: ObjectModel, frame: PreparedFrame, poses: Tensor, iterations: int, *,
               keep_all: bool = False) -> RegisterTicket:
        """Copy the frame (filtered, on the device) and the hypotheses (N, 4, 4) float32 in, replay (or run the step),
        copy the pick out; everything enqueued on the runner's stream after the caller's current stream, without
        waiting for the GPU. The caller's stream then waits (GPU-side) for the copy-in, so the caller may overwrite
        or free its tensors afterwards. keep_all: also keep device copies of every refined pose and score in the
        ticket (made on the runner's stream: valid once the ticket is collected)."""
        n = int(poses.shape[0])
        if n == 0:
            raise ValueError("poses: expected at least one hypothesis; got none")
        if tuple(poses.shape) != (n, 4, 4):
            raise ValueError(f"poses: expected (N, 4, 4) hypotheses; got {tuple(poses.shape)}")
        hw = frame.hw
        with self._lock:
            entry = self._entry(obj, n, hw, iterations)
            if self._stream is None:  # CPU: the same step, inline
                _copy_in(entry.buffers, frame, poses)
                self._step(entry)
                return self._ticket(entry, keep_all, done=None, replayed=False)
            with torch.cuda.device(self.device):
                self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the frame's filters, hypotheses
                with torch.cuda.stream(self._stream):
                    _copy_in(entry.buffers, frame, poses)
                    copied = torch.cuda.Event()
                    copied.record(self._stream)
                    replayed = self._launch(entry)
                    # blocking: the collecting thread sleeps through the ~80 ms of a register instead of spinning a
                    # core that the server's event loop, ingest workers and track lane want under load
                    done = torch.cuda.Event(blocking=True)
                    ticket = self._ticket(entry, keep_all, done=done, replayed=replayed)
                    done.record(self._stream)
                # The caller's tensors are read on the runner's stream, after its earlier replays: what the caller
                # enqueues next (e.g. the next frame's upload into the same pool slot, once this package is done or
                # dropped) waits for the copy-in, and the allocator does not reuse them before it.
                torch.cuda.current_stream(self.device).wait_event(copied)
            for t in (frame.rgb, frame.depth, frame.xyz_cam, poses):
                t.record_stream(self._stream)
            return ticket

    def run(self, obj: ObjectModel, frame: PreparedFrame, poses: Tensor, iterations: int) -> tuple[np.ndarray, float, int]:
        """:meth:`submit` and :meth:`collect`: ``(cam_from_centred (4, 4) float32, score, index)`` of the best."""
        return self.collect(self.submit(obj, frame, poses, iterations))

    @staticmethod
    def collect(ticket: RegisterTicket) -> tuple[np.ndarray, float, int]:
        """Wait for a submitted register (its one event): ``(cam_from_centred (4, 4) float32, score, index)``."""
        if ticket.done is not None:
            ticket.done.synchronize()
        block = ticket.host.numpy()
        return block[:4].copy(), float(block[4, 0]), int(block[4, 1])

    def _ticket(self, entry: _Entry, keep_all: bool, *, done: torch.cuda.Event | None, replayed: bool) -> RegisterTicket:
        """Enqueue the copy-out of the pick (and of everything with ``keep_all``) on the current stream."""
        b = entry.buffers
        pinned = self._stream is not None
        host = torch.empty((5, 4), dtype=torch.float32, pin_memory=pinned)
        block = torch.cat([
            b.out_poses.index_select(0, b.best.reshape(1))[0],
            torch.stack([b.scores.index_select(0, b.best.reshape(1))[0], b.best.to(torch.float32),
                         torch.zeros((), device=b.scores.device), torch.zeros((), device=b.scores.device)])[None],
        ])
        host.copy_(block, non_blocking=pinned)
        poses = b.out_poses.clone() if keep_all else None
        scores = b.scores.clone() if keep_all else None
        return RegisterTicket(host=host, done=done, replayed=replayed, poses=poses, scores=scores)

    # -- capture ----------------------------------------------------------------------------------------------------

    def _entry(self, obj: ObjectModel, n: int, hw: tuple[int, int], iterations: int) -> _Entry:
        def make() -> _Entry:
            refine, score, _ = _forwards(self.refiner, self.scorer, n)
            return _Entry(obj, RegisterBuffers(n, hw, self.device), int(iterations), refine, score)

        return self._steps.get(_key(obj, n, hw, iterations), make, self._step)

    def _step(self, entry: _Entry) -> None:
        with torch.no_grad():
            register_step(
                entry.buffers, entry.obj, self.renderer, entry.refine, entry.score, iterations=entry.iterations,
                crop_size=self.crop_size, constants=self.constants, network_input_impl=self.network_input_impl,
            )


def _key(obj: ObjectModel, n: int, hw: tuple[int, int], iterations: int) -> tuple:
    """The cache key of one captured register step: (id(obj), N, H, W, iterations)."""
    return (id(obj), int(n), int(hw[0]), int(hw[1]), int(iterations))


def _copy_in(buffers: RegisterBuffers, frame: PreparedFrame, poses: Tensor) -> None:
    """The frame (filtered, on the device) and the hypotheses into the static buffers, on the current stream."""
    buffers.rgb.copy_(frame.rgb, non_blocking=True)
    buffers.depth.copy_(frame.depth, non_blocking=True)
    buffers.xyz.copy_(frame.xyz_cam, non_blocking=True)
    cuda = buffers.K.device.type == "cuda"
    # pinned (the caching host allocator keeps it until the copy is done): a pageable copy would wait for the stream
    k_host = torch.empty((3, 3), dtype=torch.float64, pin_memory=cuda)
    k_host.numpy()[...] = np.asarray(frame.K, dtype=np.float64)
    buffers.K.copy_(k_host, non_blocking=cuda)
    buffers.poses.copy_(poses, non_blocking=True)
