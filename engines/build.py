"""Build TensorRT plans from the refiner/scorer ONNX files (TensorRT >= 10 Python API).

    python -m engines.build --onnx DIR --out DIR [--fp16] [--max-batch 252] [--track-max-batch 64]

Each plan holds two optimisation profiles, so batch-1 tracking does not run on kernels
tuned for 252 (a weakness of the reference's single-profile engines):

* profile 0, ``register``: min 1, opt ``max_batch`` (252), max ``max_batch``;
* profile 1, ``track``: min 1, opt 1, max ``track_max_batch`` (batched sessions).

Plans are cached under ``--out`` by a key of ONNX hash + TensorRT version + GPU name +
precision + profiles, built under a file lock and published atomically
(:mod:`engines.plan_cache`). A timing cache next to them speeds up rebuilds.

TensorRT is optional: without it this command exits with a clear message.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deploy_core.errors import EngineError
from deploy_core.infer._trt_support import import_tensorrt, make_trt_logger
from engines.plan_cache import atomic_write_bytes, file_sha256, get_or_build, locked, plan_cache_key
from foundationpose.models.blocks import C_IN, CROP_SIZE

__all__ = ["BuildConfig", "ProfileSpec", "build_plan", "main", "plan_path_for", "profiles_for"]

log = logging.getLogger(__name__)

INPUT_NAMES = ("render_input", "transf_input")
CROP_SHAPE = (CROP_SIZE, CROP_SIZE, C_IN)  # one NHWC crop (spec §6.1)
PROFILE_NAMES = ("register", "track")


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    name: str
    min_batch: int
    opt_batch: int
    max_batch: int

    def as_dict(self) -> dict:
        return {"name": self.name, "min": self.min_batch, "opt": self.opt_batch, "max": self.max_batch}


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildConfig:
    precision: str = "fp16"  # fp32 | fp16 | bf16
    max_batch: int = 252
    track_max_batch: int = 64
    workspace_gib: float = 8.0

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"precision must be fp32, fp16 or bf16; got {self.precision!r}")
        if not 1 <= self.track_max_batch <= self.max_batch:
            raise ValueError("need 1 <= track_max_batch <= max_batch")


def profiles_for(config: BuildConfig) -> tuple[ProfileSpec, ...]:
    return (
        ProfileSpec("register", 1, config.max_batch, config.max_batch),
        ProfileSpec("track", 1, 1, config.track_max_batch),
    )


def _gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        raise EngineError("building a TensorRT plan needs a CUDA GPU", backend="tensorrt")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} sm{props.major}{props.minor}"


def plan_path_for(onnx_path: Path, out_dir: Path, config: BuildConfig) -> Path:
    """Where the cached plan for this ONNX file, TensorRT, GPU and settings lives."""
    trt = import_tensorrt()
    key = plan_cache_key(
        onnx_sha256=file_sha256(onnx_path),
        trt_version=str(trt.__version__),
        gpu_name=_gpu_name(),
        precision=config.precision,
        profiles=[p.as_dict() for p in profiles_for(config)],
    )
    return out_dir / f"{onnx_path.stem}.{config.precision}.{key}.plan"


def build_plan(onnx_path: Path, out_dir: Path, config: BuildConfig = BuildConfig()) -> tuple[Path, bool]:
    """Build (or find in the cache) the plan for ``onnx_path``; returns (path, built_now)."""
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise EngineError(f"ONNX file not found: {onnx_path}", backend="tensorrt", engine_path=str(onnx_path))
    out_dir = Path(out_dir)
    path = plan_path_for(onnx_path, out_dir, config)
    return get_or_build(path, lambda: _build_serialized(onnx_path, out_dir, config))


def _build_serialized(onnx_path: Path, out_dir: Path, config: BuildConfig) -> bytes:
    trt = import_tensorrt()
    trt_log = make_trt_logger(trt)
    builder = trt.Builder(trt_log)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, trt_log)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"ONNX parse failed: {errors}", backend="tensorrt", engine_path=str(onnx_path))

    build_config = builder.create_builder_config()
    build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(config.workspace_gib * (1 << 30)))
    if config.precision == "fp16":
        build_config.set_flag(trt.BuilderFlag.FP16)
    elif config.precision == "bf16":
        build_config.set_flag(trt.BuilderFlag.BF16)

    timing_cache_path = out_dir / "timing.cache"
    with locked(timing_cache_path.with_name("timing.cache.lock")):
        cache_bytes = timing_cache_path.read_bytes() if timing_cache_path.exists() else b""
    timing_cache = build_config.create_timing_cache(cache_bytes)
    build_config.set_timing_cache(timing_cache, False)

    input_names = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(input_names) != sorted(INPUT_NAMES):
        raise EngineError(
            f"ONNX inputs {input_names} do not match the expected {list(INPUT_NAMES)}",
            backend="tensorrt",
            engine_path=str(onnx_path),
        )
    for spec in profiles_for(config):
        profile = builder.create_optimization_profile()
        for name in INPUT_NAMES:
            profile.set_shape(
                name,
                (spec.min_batch, *CROP_SHAPE),
                (spec.opt_batch, *CROP_SHAPE),
                (spec.max_batch, *CROP_SHAPE),
            )
        build_config.add_optimization_profile(profile)

    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, build_config)
    if serialized is None:
        detail = "; ".join(trt_log.take()) or "no message from TensorRT"
        raise EngineError(f"TensorRT build failed: {detail}", backend="tensorrt", engine_path=str(onnx_path))
    log.info("built %s in %.1f s", onnx_path.name, time.perf_counter() - start)

    with locked(timing_cache_path.with_name("timing.cache.lock")):
        atomic_write_bytes(timing_cache_path, bytes(build_config.get_timing_cache().serialize()))
    return bytes(serialized)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--onnx", type=Path, required=True, help="directory with refiner.onnx and scorer.onnx")
    parser.add_argument("--out", type=Path, required=True, help="plan cache directory")
    parser.add_argument("--fp16", action="store_true", help="allow fp16 kernels (I/O stays float32)")
    parser.add_argument("--bf16", action="store_true", help="allow bf16 kernels")
    parser.add_argument("--max-batch", type=int, default=252, help="register profile max/opt batch (default 252)")
    parser.add_argument("--track-max-batch", type=int, default=64, help="track profile max batch (default 64)")
    parser.add_argument("--workspace-gib", type=float, default=8.0, help="builder workspace limit (default 8 GiB)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    try:
        config = BuildConfig(
            precision=precision,
            max_batch=args.max_batch,
            track_max_batch=args.track_max_batch,
            workspace_gib=args.workspace_gib,
        )
        for name in ("refiner", "scorer"):
            path, built = build_plan(args.onnx / f"{name}.onnx", args.out, config)
            print(f"{name}: {path} ({'built' if built else 'cached'})")
    except (EngineError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
