"""A register that fails in the middle of the register lane, after its GPU work was enqueued, returns its slot; the
next frame leased into the same slot still gets the reference pose (the runner's stream orders its copy-in after the
failed frame's work). Run on the eager step everywhere and, on CUDA, on the captured one (one graph replay a step)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foundationpose.errors import RenderError
from foundationpose.mesh import load_object
from foundationpose.synthetic.meshes import make_procedural_mesh

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


@pytest.mark.parametrize(("device", "capture"), [
    pytest.param("cpu", False, id="cpu-eager", marks=pytest.mark.slow),
    pytest.param("cuda", False, id="cuda-eager", marks=[pytest.mark.cuda, _CUDA]),
    pytest.param("cuda", True, id="cuda-captured", marks=[pytest.mark.cuda, _CUDA]),
])
def test_frame_after_a_mid_lane_failure_gets_the_reference_pose(scene, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                                 device: str, capture: bool) -> None:
    from foundationpose.estimator import EstimatorConfig, PoseEstimator
    from foundationpose.runtime import RuntimeConfig
    from foundationpose.service import PoseService, ServiceConfig

    # one refine iteration on the CPU (the slot's return does not depend on how many the step runs), two on CUDA
    config = EstimatorConfig(num_hypotheses=6, register_iterations=1 if device == "cpu" else 2, track_iterations=2)
    runtime = RuntimeConfig(device=device, renderer="cpu" if device == "cpu" else "triton", capture=capture)
    estimator = PoseEstimator.create(runtime=runtime, config=config)
    obj = dataclasses.replace(scene.obj, tensors=scene.obj.tensors.to(device))
    poison = load_object(make_procedural_mesh("textured_asym"))
    poison = dataclasses.replace(poison, tensors=poison.tensors.to(device))
    want = estimator.register(obj, scene.rgb, scene.depth, scene.mask, scene.K)

    runner = estimator.register_runner
    real_submit = runner.submit
    failed: list[bool] = []

    def submit_then_fail_on_poison(step_obj, frame, poses, iterations, **kwargs):  # noqa: ANN001, ANN202
        """The poison frame's step is enqueued behind ~0.2 s of GPU work (its copy-in and replay run late), then
        the lane stage raises: the package fails in ``refine_score`` with its work still queued."""
        if step_obj is not poison:
            return real_submit(step_obj, frame, poses, iterations, **kwargs)
        if frame.depth.is_cuda:
            torch.cuda._sleep(400_000_000)
        real_submit(step_obj, frame, poses, iterations, **kwargs)
        failed.append(True)
        raise RenderError("poison mesh: fails after its step was enqueued (injected)")

    monkeypatch.setattr(runner, "submit", submit_then_fail_on_poison)
    # each round: a failure, then the same slot again; twice on the CPU (every round there is two registers of seconds,
    # and the second proves the slot came back from a failure once more), three times on CUDA
    rounds = 2 if device == "cpu" else 3
    with PoseService(estimator, ServiceConfig(max_image_hw=(120, 160), frames_in_flight=1)) as service:
        for _ in range(rounds):
            bad = service.submit_register(poison, scene.rgb, scene.depth, scene.mask, scene.K)
            good = service.submit_register(obj, scene.rgb, scene.depth, scene.mask, scene.K)  # the same slot
            with pytest.raises(RenderError, match=r"^poison mesh: fails after its step was enqueued"):
                bad.result(timeout=600)
            got = good.result(timeout=600)
            # one estimator, one step at the same batch: bit for bit on the CPU, the same kernels on CUDA
            torch.testing.assert_close(torch.as_tensor(got.cam_from_mesh), torch.as_tensor(want.cam_from_mesh),
                                       rtol=0, atol=0 if device == "cpu" else 1e-5)
        stats = service.stats()
    assert failed == [True] * rounds
    assert stats.register_pool.leased == 0 and stats.register.stage("refine_score").errors == rounds
    if capture:
        assert stats.register_captures >= 2  # the poison's step and the object's, each one graph
