"""The refiner and scorer behind deploy_core's inference-core interface.

Every backend speaks the community ONNX interface (spec §6.1): inputs ``render_input`` (A,
rendered) and ``transf_input`` (B, real), both ``(N, 160, 160, 6)`` float32 NHWC; refiner
outputs ``trans`` and ``rot`` ``(N, 3)``; scorer output ``scores`` ``(N, 1)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from deploy_core.infer import BaseInferCore, TensorSpec, make_infer_core
from foundationpose.models.blocks import C_IN, CROP_SIZE  # the networks' input (spec §2.8 network input)

__all__ = [
    "NetworkConfig",
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


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkConfig:
    """How the two networks are run.

    weights: weights root in the official layout (``<root>/<run>/model_best.pth``); ``None``
        writes/reuses deterministic random weights (poses are then meaningless).
    backend: ``torch`` | ``onnxruntime`` | ``tensorrt``.
    precision: ``fp32`` | ``fp16`` | ``bf16``; ``auto`` = fp16 on CUDA (the reference's autocast), fp32 on CPU.
    max_batch: engine capacity; 252 = the register hypothesis count (spec §2.1).
    engine_dir: where ONNX files / TensorRT plans live (onnxruntime and tensorrt backends).
    trust_weights_file: allow checkpoints that need full unpickling (runs code from the file; see
        ``foundationpose.weights.load_refiner``).
    fold_batchnorm: torch backend: run copies of the networks with every batch norm folded into the
        convolution before it (:func:`foundationpose.models.fold.fold_batchnorm`): the same function, values
        within rounding of the unfolded networks, one memory-bound pass less per convolution.
    pad_input_channels: torch backend: the first convolution takes 8 channels (the 6 inputs + 2 zero planes, zero
        weights; :func:`foundationpose.models.fold.pad_input_channels`): the same sums, a faster cuDNN kernel.
    compile_track: torch + CUDA: compile the track refiner (inductor, default mode, dynamic batch) and capture
        the compiled kernels in its CUDA graphs and in the captured track steps (fewer, fused launches per step;
        costs start-up time).
    """

    weights: Path | None = None
    backend: str = "torch"
    precision: str = "auto"
    max_batch: int = 252
    engine_dir: Path | None = None
    cuda_graph_batches: tuple[int, ...] = ()
    track_graph_batches: tuple[int, ...] = ()  # torch + CUDA: graphs of the track lane's refiner
    channels_last: bool = False
    cast_model: bool = False  # torch: half weights instead of autocast (faster, no fp32 islands)
    compile: bool = False
    compile_mode: str | None = None  # torch.compile mode, e.g. "max-autotune" or "reduce-overhead" (CUDA graphs)
    fold_batchnorm: bool = False  # torch: fold each batch norm into its conv (one pass less; rounding differs)
    pad_input_channels: bool = False  # torch: first conv on 8 channels (6 + 2 zero planes): a faster cuDNN kernel
    compile_track: bool = False  # torch + CUDA: torch.compile the track refiner too (dynamic batch, inside its graphs)
    trust_weights_file: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("torch", "onnxruntime", "tensorrt"):
            raise ValueError(f"backend must be torch, onnxruntime or tensorrt; got {self.backend!r}")
        if self.precision not in ("auto", "fp32", "fp16", "bf16"):
            raise ValueError(f"precision must be auto, fp32, fp16 or bf16; got {self.precision!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1; got {self.max_batch}")

    def resolved_precision(self, device: torch.device) -> str:
        if self.precision != "auto":
            return self.precision
        return "fp16" if device.type == "cuda" else "fp32"

    def fast_path(self, track_max_batch: int, *, compile: bool = True, compile_track: bool = False,
                  fold_batchnorm: bool = False, pad_input_channels: bool = False) -> NetworkConfig:
        """This config with the torch fast path: half weights instead of autocast, channels-last, ``torch.compile``
        of the register batch (``compile``), CUDA graphs of the track refiner for batches 1, 2, 4, ... up to
        ``track_max_batch``, plus the opt-in rewrites named by the keywords. Each changes values by rounding only
        (tested against the plain networks); CUDA + the torch backend only (the caller decides where it applies).
        """
        if track_max_batch < 1:
            raise ValueError(f"track_max_batch must be >= 1; got {track_max_batch}")
        sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < track_max_batch) + (track_max_batch,)
        return replace(
            self, cast_model=True, channels_last=True, compile=compile, track_graph_batches=sizes,
            compile_track=compile_track, fold_batchnorm=fold_batchnorm, pad_input_channels=pad_input_channels,
        )


@dataclass(slots=True)
class PoseNetworks:
    """The inference cores plus where their weights came from.

    ``track_refiner`` is the refiner for the track lane: the same weights in a core tuned for
    small batches (CUDA graphs for ``NetworkConfig.track_graph_batches`` with torch; the track
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


def load_networks(config: NetworkConfig, device: torch.device | str, *,
                  engine_files: EngineFiles | None = None) -> PoseNetworks:
    """Load (or randomly initialise) the refiner and scorer and wrap them in inference cores.

    engine_files: required for the onnxruntime and tensorrt backends (``engines.files.engine_files``).
    """
    from foundationpose.models import RefinerHWC, ScorerHWC
    from foundationpose.models.fold import fold_batchnorm, pad_input_channels
    from foundationpose.weights import ensure_weights, load_refiner, load_scorer

    if config.backend != "torch" and engine_files is None:
        raise ValueError(f"backend {config.backend!r} needs engine files: pass "
                         "engine_files=engines.files.engine_files (from the engines package)")
    device = torch.device(device)
    root, is_random = ensure_weights(config.weights)
    precision = config.resolved_precision(device)
    if config.backend == "torch":
        trust = config.trust_weights_file
        refiner_net = load_refiner(root, device=device, trust_file=trust)
        scorer_net = load_scorer(root, device=device, trust_file=trust)
        if config.fold_batchnorm:
            refiner_net, scorer_net = fold_batchnorm(refiner_net), fold_batchnorm(scorer_net)
        if config.pad_input_channels:
            refiner_net, scorer_net = pad_input_channels(refiner_net), pad_input_channels(scorer_net)
        refiner_module, scorer_module = RefinerHWC(refiner_net), ScorerHWC(scorer_net)
        common = dict(
            max_batch=config.max_batch,
            device=device,
            precision=precision,
            channels_last=config.channels_last,
            cast_model=config.cast_model,
            cuda_graph_batches=config.cuda_graph_batches,
            compile=config.compile,
            compile_kwargs={"mode": config.compile_mode} if config.compile_mode else None,
        )
        refiner = make_infer_core(
            "torch", module=refiner_module, inputs=REFINER_INPUTS, outputs=REFINER_OUTPUTS, name="refiner", **common
        )
        scorer = make_infer_core(
            "torch", module=scorer_module, inputs=SCORER_INPUTS, outputs=SCORER_OUTPUTS, name="scorer", **common
        )
        track_refiner = None
        if config.track_graph_batches and device.type == "cuda":
            track_common = dict(common, cuda_graph_batches=config.track_graph_batches, compile=config.compile_track,
                                compile_kwargs={"dynamic": True} if config.compile_track else None)
            track_refiner = make_infer_core(
                "torch", module=refiner_module, inputs=REFINER_INPUTS, outputs=REFINER_OUTPUTS,
                name="track_refiner", **track_common,
            )
    else:
        refiner, scorer, track_refiner = _load_engine_files(config, root, device, precision, engine_files)
    log.info(
        "networks ready: backend=%s precision=%s device=%s weights=%s%s%s",
        config.backend,
        precision,
        device,
        root,
        "".join(note for flag, note in ((config.fold_batchnorm, " (batch norms folded)"),
                                        (config.pad_input_channels, " (input channels padded to 8)"))
                if flag and config.backend == "torch"),
        " (RANDOM: poses are meaningless)" if is_random else "",
    )
    return PoseNetworks(
        refiner=refiner,
        scorer=scorer,
        weights_root=root,
        random_weights=is_random,
        precision=precision,
        track_refiner=track_refiner,
    )


def _load_engine_files(
    config: NetworkConfig, root: Path, device: torch.device, precision: str, engine_files: EngineFiles
) -> tuple[BaseInferCore, BaseInferCore, BaseInferCore | None]:
    paths = engine_files(
        weights_root=root,
        engine_dir=config.engine_dir,
        backend=config.backend,
        precision=precision,
        max_batch=config.max_batch,
        device=device,
    )
    refiner = make_infer_core(
        config.backend, path=paths["refiner"], max_batch=config.max_batch, device=device, name="refiner"
    )
    scorer = make_infer_core(config.backend, path=paths["scorer"], max_batch=config.max_batch, device=device, name="scorer")
    track_refiner = None
    if config.backend == "tensorrt":  # profile 1 of our plans is the track profile (engines.build)
        track_refiner = make_infer_core(
            "tensorrt", path=paths["refiner"], max_batch=min(64, config.max_batch), device=device,
            name="track_refiner", profile_index=1,
        )
    return refiner, scorer, track_refiner
