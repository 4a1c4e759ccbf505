"""RuntimeConfig: the defaults are the fast path on CUDA and the reference on the CPU; PoseEstimator.create takes it
or its shortcuts and refuses disagreements; make_renderer("auto") follows the Triton self-check."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from foundationpose.estimator import EstimatorConfig, PoseEstimator, runtime_with
from foundationpose.render import RenderConfig, make_renderer, triton_self_check
from foundationpose.render import factory as render_factory
from foundationpose.runtime import DEFAULT_COMPILE_CACHE, RuntimeConfig, resolve_device

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_the_defaults_are_the_fast_path_on_cuda_and_the_reference_on_the_cpu() -> None:
    runtime = RuntimeConfig()
    assert (runtime.capture, runtime.compile, runtime.compile_cache) == (True, True, DEFAULT_COMPILE_CACHE)
    assert runtime.resolved_precision(CUDA) == "fp16" and runtime.fast_networks(CUDA) and runtime.compiles(CUDA)
    assert runtime.resolved_precision(CPU) == "fp32" and not runtime.fast_networks(CPU) and not runtime.compiles(CPU)
    assert not RuntimeConfig(precision="fp32").fast_networks(CUDA)  # fp32 on CUDA: the official modules
    assert not RuntimeConfig(backend="onnxruntime").fast_networks(CUDA)
    assert not RuntimeConfig(compile=False).compiles(CUDA)
    record = runtime.describe(CUDA)
    assert record["precision"] == "fp16" and record["fast_networks"] and record["compile_cache"] == str(DEFAULT_COMPILE_CACHE)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"backend": "jax"}, r"^backend must be one of torch, onnxruntime, tensorrt; got 'jax'$"),
    ({"precision": "fp8"}, r"^precision must be one of auto, fp32, fp16, bf16; got 'fp8'$"),
    ({"renderer": "opengl"}, r"^renderer must be one of auto, cpu, nvdiffrast, triton; got 'opengl'$"),
    ({"max_batch": 0}, r"^max_batch must be >= 1; got 0$"),
    ({"device": "tpu"}, r"^device must be auto, cpu, cuda or cuda:N; got 'tpu'$"),
])
def test_bad_settings_are_refused_with_the_field_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**kwargs)


def test_paths_are_paths_and_cuda_is_checked_when_resolved() -> None:
    runtime = RuntimeConfig(weights="w", engine_dir="e", compile_cache="c")  # type: ignore[arg-type]
    assert (runtime.weights, runtime.engine_dir, runtime.compile_cache) == (Path("w"), Path("e"), Path("c"))
    assert resolve_device("cpu") == CPU
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device cuda requested but CUDA is not available"):
            RuntimeConfig(device="cuda").resolved_device()


def test_create_shortcuts_agree_with_the_runtime_or_are_refused() -> None:
    runtime = RuntimeConfig(device="cpu", renderer="cpu", weights=Path("w"))
    assert runtime_with(None, device="cpu", weights="w") == RuntimeConfig(device="cpu", weights=Path("w"))
    assert runtime_with(runtime, device="cpu", weights="w", renderer="cpu") is runtime  # the same values: fine
    with pytest.raises(ValueError, match=r"^weights='other' disagrees with runtime.weights=PosixPath\('w'\): pass "
                                         r"it in one place$"):
        runtime_with(runtime, weights="other")
    with pytest.raises(ValueError, match=r"^precision='bf16' disagrees with runtime.precision='auto'"):
        PoseEstimator.create(runtime=runtime, precision="bf16")


def test_create_builds_the_reference_on_the_cpu(tiny_estimator) -> None:
    if tiny_estimator.device.type != "cpu":
        pytest.skip("the CPU reference")
    assert tiny_estimator.capture and not tiny_estimator.track_runner.capturable
    assert not tiny_estimator.register_runner.capturable and tiny_estimator.compile_cache is None
    assert tiny_estimator.networks.precision == "fp32" and tiny_estimator.renderer.name == "cpu"
    assert isinstance(tiny_estimator.config, EstimatorConfig)


def test_auto_is_the_cpu_rasteriser_on_a_cpu_device() -> None:
    assert make_renderer("auto", "cpu").name == "cpu"
    with pytest.raises(ValueError, match=r"^renderer name must be one of auto, cpu, nvdiffrast, triton; got 'gl'$"):
        make_renderer("gl", "cpu")


@pytest.mark.slow
def test_the_self_check_passes_for_the_triton_rasteriser_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    from tests.foundationpose._triton import raster_interpreter_problem

    if (problem := raster_interpreter_problem()) is not None:
        pytest.skip(problem)
    assert triton_self_check(CPU) is None
    assert triton_self_check(CPU) is None  # remembered: the second answer costs nothing


def test_auto_on_cuda_falls_back_and_says_why_once(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A failed self-check makes auto fall back (to nvdiffrast, else the CPU rasteriser) with a warning that names
    the reason, logged once however many renderers are made."""
    from foundationpose.render import nvdiffrast_backend

    monkeypatch.setattr(render_factory, "triton_self_check", lambda device, config=None: "kernels differ (injected)")
    monkeypatch.setattr(nvdiffrast_backend, "has_nvdiffrast", lambda: False)
    monkeypatch.setattr(render_factory, "_choices", set())
    made = []

    class Recording:  # the CPU rasteriser needs no CUDA to be constructed; record what auto picked
        def __init__(self, device, config) -> None:
            made.append(torch.device(device))
            self.name, self.device, self.config = "cpu", torch.device(device), config

    monkeypatch.setattr("foundationpose.render.cpu_raster.CpuRasterizer", Recording)
    with caplog.at_level(logging.INFO, logger="foundationpose.render.factory"):
        first = make_renderer("auto", "cuda:0", RenderConfig())
        make_renderer("auto", "cuda:0", RenderConfig())
    assert first.name == "cpu" and made == [torch.device("cuda:0")] * 2
    failed = [r for r in caplog.records if "failed its self-check" in r.getMessage()]
    assert len(failed) == 1 and "kernels differ (injected)" in failed[0].getMessage()
    assert failed[0].levelno == logging.WARNING
