"""Faults inside the lanes: one bad item of a track batch fails alone; expired requests are dropped
before they cost anything and return their slot."""

from __future__ import annotations

import time

import numpy as np
import pytest

from deploy_core.errors import DeadlineError
from foundationpose.errors import NonFinitePoseError, RenderError
from foundationpose.estimator import PoseEstimator
from foundationpose.mesh import MeshTensors, load_object
from foundationpose.render import Renderer, make_renderer
from foundationpose.render.groups import RowMeshes
from foundationpose.service import PoseService, ServiceConfig
from foundationpose.synthetic.meshes import make_procedural_mesh

from .conftest import assert_same_pose, on_test_device


class FaultyRenderer:
    """The estimator's renderer, except for two meshes: one whose render raises, one that renders NaN colours
    (a real seam: the lanes render through the estimator's renderer, ``spawn`` makes one per stage on CUDA)."""

    def __init__(self, base: Renderer, raise_for: MeshTensors, nan_for: MeshTensors) -> None:
        self.base, self.raise_for, self.nan_for = base, raise_for, nan_for
        self.name, self.device, self.config = base.name, base.device, base.config

    def spawn(self) -> FaultyRenderer:
        return FaultyRenderer(make_renderer(self.base.name, self.device, self.config), self.raise_for, self.nan_for)

    def render(self, mesh: MeshTensors | RowMeshes, *args, **kwargs):  # type: ignore[no-untyped-def]
        meshes = mesh.group.meshes if isinstance(mesh, RowMeshes) else (mesh,)  # a group step renders its rows'
        if any(m is self.raise_for for m in meshes):
            raise RenderError("render failed for this mesh (injected)")
        out = self.base.render(mesh, *args, **kwargs)
        for k, m in enumerate(meshes):
            if m is self.nan_for:
                rows = (mesh.row_mesh == k) if isinstance(mesh, RowMeshes) else slice(None)
                out.rgb[rows] = float("nan")
        return out


@pytest.mark.slow
def test_one_bad_item_inside_a_track_batch_fails_alone(scene, tiny_estimator) -> None:
    raising = on_test_device(load_object(make_procedural_mesh("textured_asym")))
    nan_obj = on_test_device(load_object(make_procedural_mesh("textured_asym")))
    estimator = PoseEstimator(tiny_estimator.networks, FaultyRenderer(tiny_estimator.renderer, raising.tensors,
                                                                      nan_obj.tensors),
                              device=tiny_estimator.device, config=tiny_estimator.config)
    prev = scene.cam_from_mesh.copy()
    prev[:3, 3] += (0.004, -0.003, 0.006)
    want = tiny_estimator.track(scene.obj, scene.rgb, scene.depth, scene.K, prev).cam_from_mesh
    config = ServiceConfig(max_image_hw=(120, 160), track_max_batch=3, track_max_wait_ms=10_000.0)
    with PoseService(estimator, config) as service:
        service._batcher.idle_dispatch = False  # the batch closes when all three are in
        futures = [service.submit_track(obj, scene.rgb, scene.depth, scene.K, prev, key=key)
                   for obj, key in ((raising, "r"), (scene.obj, "good"), (nan_obj, "nan"))]
        with pytest.raises(RenderError, match=r"^render failed for this mesh \(injected\)") as info:
            futures[0].result(timeout=300)
        assert any("stage=step" in note for note in info.value.__notes__)
        good = futures[1].result(timeout=300)
        with pytest.raises(NonFinitePoseError, match=r"^the refined pose has \d+ NaN or inf entries "
                                                     r"\(request key='nan'\)"):
            futures[2].result(timeout=300)
        stats = service.stats()
    assert_same_pose(good.cam_from_mesh, want)                  # the batch mates changed nothing
    assert good.timings_ms["batch"] == 3.0             # all three shared one refiner call
    assert stats.track.stage("finish").errors == 0 and stats.track_pool.leased == 0


def test_expired_requests_are_dropped_before_any_work_and_return_their_slot(scene, tiny_estimator) -> None:
    config = ServiceConfig(max_image_hw=(120, 160), frames_in_flight=1, track_max_batch=1)
    with PoseService(tiny_estimator, config) as service:
        register = service.submit_register(scene.obj, scene.rgb, scene.depth, scene.mask, scene.K,
                                           deadline=time.monotonic())
        with pytest.raises(DeadlineError, match=r"^pipeline 'register': package \d+ passed its deadline .* "
                                                r"before stage 'upload'; dropped$"):
            register.result(timeout=60)
        track = service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, scene.cam_from_mesh,
                                     deadline=time.monotonic())
        with pytest.raises(DeadlineError, match=r"^track-batcher: the request passed its deadline"):
            track.result(timeout=60)
        # nothing ran for either, and the one register slot is free again
        stats = service.stats()
        assert stats.register.stage("upload").count == 0 and stats.track.stage("step").count == 0
        assert stats.register_pool.leased == 0 and stats.track_batcher.dropped == 1
        later = service.submit_track(scene.obj, scene.rgb, scene.depth, scene.K, scene.cam_from_mesh,
                                     deadline=time.monotonic() + 300)
        assert np.isfinite(later.result(timeout=300).cam_from_mesh).all()
