"""Synthetic tracking scenarios and sensor-like depth: what each scenario promises, checked on its ground truth."""

from __future__ import annotations

import numpy as np
import pytest

from foundationpose.mesh import load_object
from foundationpose.render import make_renderer
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.scenarios import SCENARIOS, demo_intrinsics, make_scenario
from foundationpose.synthetic.sensor import SensorDepthConfig, sensor_depth

HW = (120, 160)


@pytest.fixture(scope="module")
def renderer():
    return make_renderer("cpu", "cpu")


@pytest.fixture(scope="module")
def tee():
    return load_object(make_procedural_mesh("textured_asym", shape="tee"))


@pytest.fixture(scope="module")
def scenarios(textured_object, renderer, tee):
    return {name: make_scenario(name, textured_object, renderer, frames=30, hw=HW, seed=5, distractor=tee)
            for name in SCENARIOS}


def _visible(scenario) -> np.ndarray:
    return np.array([f.visible_fraction for f in scenario.frames])


def _steps(scenario) -> np.ndarray:
    poses = np.stack([f.cam_from_centred for f in scenario.frames])
    return np.linalg.norm(np.diff(poses[:, :3, 3], axis=0), axis=1)


def test_sensor_depth_is_seeded_quantised_and_noisier_far_away() -> None:
    near, far = np.full((200, 200), 0.5), np.full((200, 200), 1.5)
    config = SensorDepthConfig(hole_fraction=0.0, blob_fraction=0.0, quantum_m=1e-6)
    noise_near = sensor_depth(near, np.random.default_rng(0), config) - 0.5
    noise_far = sensor_depth(far, np.random.default_rng(0), config) - 1.5
    assert noise_far.std() / noise_near.std() == pytest.approx(9.0, rel=0.1)  # grows with z^2
    a = sensor_depth(near, np.random.default_rng(1))
    assert np.array_equal(a, sensor_depth(near, np.random.default_rng(1))) and a.dtype == np.float32
    readings = a[a > 0]
    assert np.allclose(readings * 1000, np.round(readings * 1000), atol=1e-3)  # whole millimetres
    assert 0.02 < (a == 0).mean() < 0.08  # single-pixel holes and blobs
    assert (sensor_depth(np.zeros((10, 10)), np.random.default_rng(0)) == 0).all()
    step = np.where(np.arange(200)[None, :] < 100, 0.5, 0.9) * np.ones((200, 1))
    edge = sensor_depth(step, np.random.default_rng(2), SensorDepthConfig(hole_fraction=0.0, blob_fraction=0.0))
    assert 0.3 < (edge[:, 99:101] == 0).mean() < 0.7  # half of the mixed pixels at the jump dropped


def test_clean_stays_in_view_and_moves_smoothly(scenarios, textured_object) -> None:
    clean = scenarios["clean"]
    assert len(clean) == 30 and clean.depth["kind"] == "sensor" and clean.hw == HW
    assert (_visible(clean) > 0.9).all()
    assert _steps(clean).max() < 0.1 * textured_object.diameter
    np.testing.assert_allclose(clean.K, demo_intrinsics(HW))


def test_the_occluder_covers_everything_then_uncovers(scenarios) -> None:
    occ = scenarios["occluder"]
    visible = _visible(occ)
    first, last = occ.events["full_cover"]
    assert visible[0] > 0.9 and visible[-1] > 0.9
    assert (visible[first:last] < 0.02).all() and visible[first - 3] > visible[first - 1]  # a sweep, not a cut
    assert not occ.frames[first].mask.any()


def test_leave_and_distractor_lose_the_object_for_a_while(scenarios) -> None:
    for name in ("leave", "distractor"):
        sc = scenarios[name]
        out, back = sc.events["gone"]
        visible = _visible(sc)
        assert (visible[out:back] == 0).all() and (visible[back:] > 0.5).all() and visible[0] > 0.9
    leave = scenarios["leave"]
    out, back = leave.events["gone"]
    centre_before = leave.frames[out - 5].cam_from_centred[0, 3]
    assert np.sign(leave.frames[back].cam_from_centred[0, 3] - centre_before) < 0  # back on the other side
    dis = scenarios["distractor"]
    assert (dis.frames[dis.events["gone"][0]].depth < 0.6).any()  # the distractor stays in front of the plane


def test_the_jump_is_one_large_step(scenarios, textured_object) -> None:
    jump = scenarios["jump"]
    steps = _steps(jump)
    at = jump.events["jump"]
    assert steps[at - 1] > 0.6 * textured_object.diameter
    assert np.delete(steps, at - 1).max() < 0.1 * textured_object.diameter
    assert (_visible(jump) > 0.9).all()


def test_exact_depth_and_bad_arguments(textured_object, renderer) -> None:
    exact = make_scenario("clean", textured_object, renderer, frames=30, hw=HW, depth=None)
    assert exact.depth == {"kind": "exact"} and (exact.frames[0].depth > 0).all()
    with pytest.raises(ValueError, match=r"^scenario must be one of clean, occluder"):
        make_scenario("rain", textured_object, renderer)
    with pytest.raises(ValueError, match=r"^frames must be >= 30"):
        make_scenario("clean", textured_object, renderer, frames=5)
    with pytest.raises(ValueError, match=r"^the distractor scenario needs a distractor object"):
        make_scenario("distractor", textured_object, renderer)
