"""Engine cache: keys, atomic publication, and one build under concurrent requests."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import pytest

from engines.plan_cache import atomic_write_bytes, get_or_build, plan_cache_key

KEY_ARGS = dict(onnx_sha256="ab" * 32, trt_version="10.7.0", gpu_name="NVIDIA H200 sm90", precision="fp16",
                profiles=[{"name": "register", "min": 1, "opt": 252, "max": 252}])


def test_key_changes_with_every_input() -> None:
    base = plan_cache_key(**KEY_ARGS)
    assert base == plan_cache_key(**KEY_ARGS)
    for name, other in [("onnx_sha256", "cd" * 32), ("trt_version", "10.8.0"), ("gpu_name", "NVIDIA L4 sm89"),
                        ("precision", "fp32"), ("profiles", [])]:
        assert plan_cache_key(**{**KEY_ARGS, name: other}) != base, name


def test_atomic_write_leaves_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "x.plan"
    atomic_write_bytes(target, b"abc")
    atomic_write_bytes(target, b"defg")
    assert target.read_bytes() == b"defg"
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.plan"]


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "x.plan"

    def boom() -> bytes:
        raise RuntimeError("builder failed")

    with pytest.raises(RuntimeError, match="builder failed"):
        get_or_build(target, boom)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_threads_build_once(tmp_path: Path) -> None:
    target = tmp_path / "x.plan"
    calls: list[int] = []
    barrier = threading.Barrier(8)
    results: list[tuple[Path, bool]] = []

    def build() -> bytes:
        calls.append(1)
        return b"plan"

    def worker() -> None:
        barrier.wait()
        results.append(get_or_build(target, build))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert sum(built for _, built in results) == 1
    assert target.read_bytes() == b"plan"


def _build_in_process(target: str, counter: str) -> None:
    def build() -> bytes:
        with open(counter, "a") as f:  # one line per real build
            f.write("x\n")
        return b"plan"

    get_or_build(Path(target), build)


def test_processes_build_once(tmp_path: Path) -> None:
    target, counter = tmp_path / "x.plan", tmp_path / "builds.txt"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_build_in_process, args=(str(target), str(counter))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert counter.read_text().count("x") == 1
    assert target.read_bytes() == b"plan"


def test_build_without_tensorrt_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorrt is installed: the missing-TensorRT message is not reachable")
    from deploy_core.errors import EngineError
    from engines.build import main

    (tmp_path / "refiner.onnx").write_bytes(b"not really onnx")
    assert main(["--onnx", str(tmp_path), "--out", str(tmp_path / "plans"), "--fp16"]) == 1
    with pytest.raises(EngineError, match="TensorRT is not installed"):
        from engines.build import build_plan

        build_plan(tmp_path / "refiner.onnx", tmp_path / "plans")


def _tensorrt_skip_reason() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        return f"TensorRT is not installed here ({exc}); run on a CUDA machine with TensorRT >= 10"
    import torch

    if not torch.cuda.is_available():
        return "TensorRT plans need a CUDA GPU"
    return None


@pytest.mark.skipif(_tensorrt_skip_reason() is not None, reason=str(_tensorrt_skip_reason()))
def test_tensorrt_plans_build_once_and_match_torch(tmp_path: Path) -> None:
    import torch

    from deploy_core.infer import make_infer_core
    from engines.build import BuildConfig, build_plan
    from engines.export import export_onnx
    from foundationpose.models import RefinerHWC
    from foundationpose.weights import load_refiner, write_random_weights

    root = write_random_weights(tmp_path / "weights")
    onnx = export_onnx(root, tmp_path / "onnx")
    config = BuildConfig(precision="fp32", max_batch=4, track_max_batch=2)
    plan, built = build_plan(onnx["refiner"], tmp_path / "plans", config)
    assert built
    again, built_again = build_plan(onnx["refiner"], tmp_path / "plans", config)
    assert again == plan and not built_again
    core = make_infer_core("tensorrt", path=plan, max_batch=4, device="cuda")
    x = {n: torch.rand(3, 160, 160, 6, device="cuda") for n in ("render_input", "transf_input")}
    got = core.infer(x)
    want = RefinerHWC(load_refiner(root, device="cuda")).eval()(x["render_input"], x["transf_input"])
    torch.testing.assert_close(got["trans"], want[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got["rot"], want[1], atol=2e-3, rtol=2e-3)
