"""The refiner and scorer behind deploy_core's inference-core interface.

Every backend speaks the community ONNX interface (spec §6.1): inputs ``render_input`` (A,
rendered) and ``transf_input`` (B, real), both ``(N, 160, 160, 6)`` float32 NHWC; refiner
outputs ``trans`` and ``rot`` ``(N, 3)``; scorer output ``scores`` ``(N, 1)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from deploy_core.infer import BaseInferCore, TensorSpec, make_infer_core
from foundationpose.models.blocks import C_IN, CROP_SIZE  # the networks' input (spec §2.8 network input)
from foundationpose.runtime import RuntimeConfig

__all__ = [
    "EngineFiles",
    "PoseNetworks",
    "REFINER_INPUTS",
    "REFINER_OUTPUTS",
    "SCORER_INPUTS",
    "SCORER_OUTPUTS",
    "load_networks",
]

log = logging.getLogger(__name__)


REFINER_INPUTS = (
    TensorSpec("render_input", (-1, CROP_SIZE, CROP_SIZE, C_IN), torch.float32),
    TensorSpec("transf_input", (-1, CROP_SIZE, CROP_SIZE, C_IN), torch.float32),
)
REFINER_OUTPUTS = (
    TensorSpec("trans", (-1, 3), torch.float32),
    TensorSpec("rot", (-1, 3), torch.float32),
)
SCORER_INPUTS = REFINER_INPUTS
SCORER_OUTPUTS = (TensorSpec("scores", (-1, 1), torch.float32),)


@dataclass(slots=True)
class PoseNetworks:
    """The inference cores plus where their weights came from.

    ``track_refiner`` is the refiner for the track lane: the same weights in a core tuned for
    small batches (compiled for a dynamic batch, CUDA graphs where steps are not captured whole; the track
    optimisation profile with TensorRT), so batch-1 tracking never runs kernels tuned for 252.
    It is ``refiner`` itself where the backend has nothing to gain.
    """

    refiner: BaseInferCore
    scorer: BaseInferCore
    weights_root: Path
    random_weights: bool
    precision: str
    track_refiner: BaseInferCore | None = None

    def __post_init__(self) -> None:
        if self.track_refiner is None:
            self.track_refiner = self.refiner

    def warmup(self, register_batch: int, track_batches: tuple[int, ...] = (1,)) -> None:
        """Compile / capture / autotune at start-up so the first request does not pay for it."""
        self.refiner.warmup([register_batch])
        self.scorer.warmup([register_batch])
        if self.track_refiner is not self.refiner:
            self.track_refiner.warmup(list(track_batches))

    def close(self) -> None:
        cores = {id(c): c for c in (self.refiner, self.scorer, self.track_refiner)}
        for core in cores.values():
            core.close()


class EngineFiles(Protocol):
    """Finds (or builds) the engine files of both networks for a non-torch backend; ``engines.files.engine_files``
    is the implementation. Passed in by the applications: the algorithm package never imports ``engines``
    (which imports it to export the networks)."""

    def __call__(self, *, weights_root: Path, engine_dir: Path | None, backend: str, precision: str,
                 max_batch: int, device: torch.device) -> Mapping[str, Path]:
        """``{"refiner": path, "scorer": path}``: ONNX files for onnxruntime, plans for tensorrt."""
        ...


def load_networks(runtime: RuntimeConfig, device: torch.device | str, *, track_graph_batches: tuple[int, ...] = (),
                  engine_files: EngineFiles | None = None) -> PoseNetworks:
    """Load (or randomly initialise) the refiner and scorer and wrap them in inference cores.

    On CUDA with the torch backend and a 16-bit precision (:meth:`RuntimeConfig.fast_networks`) the cores run
    inference copies of the networks: batch norms folded into their convolutions and the first convolution on 8
    input channels (:mod:`foundationpose.models.fold`), half weights, channels-last memory; with
    :meth:`RuntimeConfig.compiles`, ``torch.compile`` (the register networks at their fixed shapes, the track
    refiner with a dynamic batch). Elsewhere the official modules run as loaded (the reference).
    track_graph_batches: batch sizes of CUDA graphs of the track refiner's own forward (for track steps that are
        not captured as a whole); empty: none.
    engine_files: required for the onnxruntime and tensorrt backends (``engines.files.engine_files``).
    """
    from foundationpose.models import RefinerHWC, ScorerHWC
    from foundationpose.models.fold import fold_batchnorm, pad_input_channels
    from foundationpose.weights import ensure_weights, load_refiner, load_scorer

    if runtime.backend != "torch" and engine_files is None:
        raise ValueError(f"backend {runtime.backend!r} needs engine files: pass "
                         "engine_files=engines.files.engine_files (from the engines package)")
    device = torch.device(device)
    root, is_random = ensure_weights(runtime.weights)
    precision = runtime.resolved_precision(device)
    fast = runtime.fast_networks(device)
    if runtime.backend == "torch":
        trust = runtime.trust_weights_file
        refiner_net = load_refiner(root, device=device, trust_file=trust)
        scorer_net = load_scorer(root, device=device, trust_file=trust)
        if fast:
            refiner_net = pad_input_channels(fold_batchnorm(refiner_net))
            scorer_net = pad_input_channels(fold_batchnorm(scorer_net))
        refiner_module, scorer_module = RefinerHWC(refiner_net), ScorerHWC(scorer_net)
        compiled = runtime.compiles(device)
        common = dict(max_batch=runtime.max_batch, device=device, precision=precision, channels_last=fast,
                      cast_model=fast, compile=compiled)
        refiner = make_infer_core(
            "torch", module=refiner_module, inputs=REFINER_INPUTS, outputs=REFINER_OUTPUTS, name="refiner", **common
        )
        scorer = make_infer_core(
            "torch", module=scorer_module, inputs=SCORER_INPUTS, outputs=SCORER_OUTPUTS, name="scorer", **common
        )
        track_refiner = None
        if device.type == "cuda":  # a core of its own: kernels for small batches, never the ones tuned for 252
            track_refiner = make_infer_core(
                "torch", module=refiner_module, inputs=REFINER_INPUTS, outputs=REFINER_OUTPUTS, name="track_refiner",
                **dict(common, cuda_graph_batches=track_graph_batches,
                       compile_kwargs={"dynamic": True} if compiled else None),
            )
    else:
        refiner, scorer, track_refiner = _load_engine_files(runtime, root, device, precision, engine_files)
    log.info("networks ready: backend=%s precision=%s device=%s weights=%s%s%s", runtime.backend, precision, device,
             root, " (fast path: folded batch norms, 8 input channels, half weights, channels-last%s)"
             % (", compiled" if runtime.compiles(device) else "") if fast else "",
             " (RANDOM: poses are meaningless)" if is_random else "")
    return PoseNetworks(
        refiner=refiner,
        scorer=scorer,
        weights_root=root,
        random_weights=is_random,
        precision=precision,
        track_refiner=track_refiner,
    )


def _load_engine_files(
    runtime: RuntimeConfig, root: Path, device: torch.device, precision: str, engine_files: EngineFiles
) -> tuple[BaseInferCore, BaseInferCore, BaseInferCore | None]:
    paths = engine_files(
        weights_root=root,
        engine_dir=runtime.engine_dir,
        backend=runtime.backend,
        precision=precision,
        max_batch=runtime.max_batch,
        device=device,
    )
    refiner = make_infer_core(
        runtime.backend, path=paths["refiner"], max_batch=runtime.max_batch, device=device, name="refiner"
    )
    scorer = make_infer_core(runtime.backend, path=paths["scorer"], max_batch=runtime.max_batch, device=device,
                             name="scorer")
    track_refiner = None
    if runtime.backend == "tensorrt":  # profile 1 of our plans is the track profile (engines.build)
        track_refiner = make_infer_core(
            "tensorrt", path=paths["refiner"], max_batch=min(64, runtime.max_batch), device=device,
            name="track_refiner", profile_index=1,
        )
    return refiner, scorer, track_refiner
