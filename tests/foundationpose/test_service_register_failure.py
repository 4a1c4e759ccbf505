"""CUDA: a register that fails in a middle stage returns its slot while its kernels may still run; the next
frame leased into the same slot must still get the reference pose (the free event orders them on the GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foundationpose.errors import RenderError
from foundationpose.mesh import MeshTensors, load_object
from foundationpose.render import Renderer, make_renderer
from foundationpose.synthetic.meshes import make_procedural_mesh

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the lease-reuse ordering is a CUDA property (run on the GPU machine)")


class LateFailingRenderer:
    """The real renderer; for the poison mesh the first render runs behind ~0.2 s of GPU work (so the slot's
    network inputs are written late) and the second one raises: the package fails in ``render_1``."""

    def __init__(self, base: Renderer, poison: MeshTensors, calls: list[int]) -> None:
        self.base, self.poison, self.calls = base, poison, calls
        self.name, self.device, self.config = base.name, base.device, base.config

    def spawn(self) -> LateFailingRenderer:
        return LateFailingRenderer(make_renderer(self.base.name, self.device, self.config), self.poison, self.calls)

    def render(self, mesh: MeshTensors, *args, **kwargs):  # type: ignore[no-untyped-def]
        if mesh is self.poison:
            self.calls.append(1)
            if len(self.calls) > 1:
                raise RenderError("poison mesh: second render fails (injected)")
            torch.cuda._sleep(400_000_000)
        return self.base.render(mesh, *args, **kwargs)


def test_frame_after_a_mid_lane_failure_gets_the_reference_pose(scene) -> None:  # noqa: ANN001
    from foundationpose.estimator import EstimatorConfig, PoseEstimator
    from foundationpose.service import PoseService, ServiceConfig

    config = EstimatorConfig(num_hypotheses=6, register_iterations=2, track_iterations=2)
    reference = PoseEstimator.create(device="cuda", renderer="auto", config=config)
    obj = dataclasses.replace(scene.obj, tensors=scene.obj.tensors.to("cuda"))
    poison = load_object(make_procedural_mesh("textured_asym"))
    poison = dataclasses.replace(poison, tensors=poison.tensors.to("cuda"))
    want = reference.register(obj, scene.rgb, scene.depth, scene.mask, scene.K)
    estimator = PoseEstimator(reference.networks, LateFailingRenderer(reference.renderer, poison.tensors, []),
                              device=reference.device, config=config)
    with PoseService(estimator, ServiceConfig(max_image_hw=(120, 160), frames_in_flight=1)) as service:
        for _ in range(3):
            del estimator.renderer.calls[:]  # a fresh poison sequence each round (shared by the stage renderers)
            bad = service.submit_register(poison, scene.rgb, scene.depth, scene.mask, scene.K)
            good = service.submit_register(obj, scene.rgb, scene.depth, scene.mask, scene.K)  # same slot
            with pytest.raises(RenderError, match=r"^poison mesh: second render fails"):
                bad.result(timeout=120)
            got = good.result(timeout=120)
            # the same tolerance as every pipelined-vs-reference check on CUDA (tests/foundationpose/conftest.py)
            torch.testing.assert_close(torch.as_tensor(got.cam_from_mesh), torch.as_tensor(want.cam_from_mesh), rtol=0, atol=1e-2)
        stats = service.stats()
    assert stats.register_pool.leased == 0 and stats.register.stage("render_1").errors == 3
