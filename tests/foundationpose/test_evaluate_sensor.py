"""The evaluation's synthetic sensor (flying pixels at depth edges, a per-frame depth bias, colour noise) and the
scenarios' timeline (every event over early enough for its 1 s recovery window to fit the default length)."""

from __future__ import annotations

import numpy as np
import pytest

from foundationpose.synthetic.scenarios import (
    DEFAULT_FRAMES,
    EVENTS_END,
    FPS,
    MIN_FRAMES,
    OBSERVE_FRAMES,
    SCENARIOS,
    make_scenario,
)
from foundationpose.synthetic.sensor import (
    SensorColourConfig,
    SensorDepthConfig,
    depth_edges,
    sensor_depth,
    sensor_rgb,
)

# only the effect under test: no noise, holes, bias or quantisation to speak of
BARE = dict(noise_m_at_1m=0.0, hole_fraction=0.0, blob_fraction=0.0, bias_max=0.0, quantum_m=1e-7)
NEAR, FAR = 0.5, 0.9


def _step(h: int = 200, w: int = 200) -> np.ndarray:
    """NEAR metres left of column w / 2, FAR from it: one vertical discontinuity between columns 99 and 100."""
    return np.where(np.arange(w)[None, :] < w // 2, NEAR, FAR) * np.ones((h, 1))


def test_depth_edges_mark_both_sides_of_a_discontinuity() -> None:
    edge, near, far = depth_edges(_step(), 0.02)
    assert edge[:, 99:101].all() and edge.sum() == 2 * 200  # one column on each side, nothing else
    assert (near[:, 99:101] == NEAR).all() and (far[:, 99:101] == FAR).all()
    flat, _, _ = depth_edges(_step() + np.arange(200)[None, :] * 1e-3, 0.02)  # a 1 mm/pixel slope: no edge
    assert flat.sum() == 2 * 200
    assert not depth_edges(np.zeros((5, 5)), 0.02)[0].any()  # no readings, no edges


def test_flying_pixels_appear_only_at_edges_and_lie_between_the_two_surfaces() -> None:
    exact = _step()
    config = SensorDepthConfig(**BARE)  # default edge dropout (0.5) and flying fraction (0.25)
    out = sensor_depth(exact, np.random.default_rng(0), config).astype(np.float64)
    changed = (out > 0) & (np.abs(out - exact) > 1e-5)
    cols = np.nonzero(changed)[1]
    assert set(cols.tolist()) == {99, 100}  # only next to the discontinuity
    assert ((out[changed] > NEAR) & (out[changed] < FAR)).all()  # between the foreground and the background
    near_side, far_side = out[:, 99][changed[:, 99]], out[:, 100][changed[:, 100]]
    middle = (NEAR + FAR) / 2  # a pixel is mostly its own surface: the near side reads nearer than half-way
    assert near_side.max() < middle + 1e-9 and far_side.min() >= middle - 1e-9
    band = out[:, 99:101]
    assert 0.4 < (band == 0).mean() < 0.6  # half of the edge pixels dropped
    assert 0.08 < changed[:, 99:101].mean() < 0.17  # a quarter of the others fly: one in eight
    assert np.allclose(out[:, :99], NEAR, atol=1e-6) and np.allclose(out[:, 101:], FAR, atol=1e-6)  # nothing else
    everything = SensorDepthConfig(**BARE, edge_dropout=0.0, flying_fraction=1.0)
    all_fly = sensor_depth(exact, np.random.default_rng(1), everything)[:, 99:101]
    assert ((all_fly > NEAR) & (all_fly < FAR)).mean() > 0.99
    none = sensor_depth(exact, np.random.default_rng(1), SensorDepthConfig(**BARE, flying_fraction=0.0))
    assert set(np.unique(none.astype(np.float64).round(6)).tolist()) == {0.0, NEAR, FAR}  # dropped or exact


def test_the_per_frame_depth_bias_scales_the_whole_frame_within_its_bound() -> None:
    exact = np.linspace(0.4, 0.6, 20 * 20).reshape(20, 20)  # a ramp, 1 cm from row to row: no edge
    config = SensorDepthConfig(**(BARE | {"bias_max": 0.002}))
    biases = []
    for seed in range(300):
        ratio = sensor_depth(exact, np.random.default_rng(seed), config) / exact
        assert ratio.max() - ratio.min() < 1e-6  # one factor for the whole frame
        biases.append(float(ratio.mean()) - 1.0)
    b = np.array(biases)
    assert np.abs(b).max() <= 0.002 + 1e-6 and np.abs(b).max() > 0.0019  # within the bound, and using it
    assert abs(b.mean()) < 0.0002 and b.std() == pytest.approx(0.002 / np.sqrt(3), rel=0.12)  # uniform
    assert len(set(np.round(b, 7))) > 250  # drawn anew every frame


def test_the_default_sensor_still_holds_its_other_effects() -> None:
    near = np.full((200, 200), 0.5)
    a = sensor_depth(near, np.random.default_rng(1))
    assert np.array_equal(a, sensor_depth(near, np.random.default_rng(1))) and a.dtype == np.float32
    readings = a[a > 0]
    assert np.allclose(readings * 1000, np.round(readings * 1000), atol=1e-3)  # whole millimetres
    assert 0.02 < (a == 0).mean() < 0.08  # single-pixel holes and blobs
    assert abs(np.median(readings) - 0.5) <= 0.0015  # bias <= 1 mm at 0.5 m, plus quantisation


def test_colour_noise_statistics() -> None:
    grey = np.full((200, 200, 3), 128, np.uint8)
    noisy = sensor_rgb(grey, np.random.default_rng(0))
    assert noisy.dtype == np.uint8 and noisy.shape == grey.shape
    diff = noisy.astype(np.float64) - 128
    assert abs(diff.mean()) < 0.03 and diff.std() == pytest.approx(np.sqrt(2.0**2 + 1 / 12), rel=0.03)
    per_channel = diff.reshape(-1, 3)
    assert np.abs(np.corrcoef(per_channel.T)[np.triu_indices(3, 1)]).max() < 0.03  # independent channels
    assert np.array_equal(noisy, sensor_rgb(grey, np.random.default_rng(0)))  # seeded
    black = sensor_rgb(np.zeros((100, 100, 3), np.uint8), np.random.default_rng(1))
    assert black.min() == 0 and 0.5 < black.mean() < 1.1  # clipped at 0: only the upper half survives
    white = sensor_rgb(np.full((100, 100, 3), 255, np.uint8), np.random.default_rng(1))
    assert white.max() == 255 and 253.9 < white.mean() < 254.5
    assert np.array_equal(sensor_rgb(grey, np.random.default_rng(2), SensorColourConfig(noise_std=0.0)), grey)


def test_sensor_configs_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^flying_fraction must be in \[0, 1\], got 1.5"):
        SensorDepthConfig(flying_fraction=1.5)
    with pytest.raises(ValueError, match=r"^noise_m_at_1m must be >= 0, got -0.001"):
        SensorDepthConfig(noise_m_at_1m=-0.001)
    with pytest.raises(ValueError, match=r"^quantum_m must be > 0 and bias_max < 0.1"):
        SensorDepthConfig(bias_max=0.2)
    with pytest.raises(ValueError, match=r"^noise_std must be >= 0, got -1"):
        SensorColourConfig(noise_std=-1)
    assert SensorDepthConfig().describe()["flying_fraction"] == 0.25
    assert SensorColourConfig().describe() == {"kind": "sensor", "noise_std": 2.0}


@pytest.fixture(scope="module")
def short_scenarios(textured_object):
    from foundationpose.mesh import load_object
    from foundationpose.render import make_renderer
    from foundationpose.synthetic.meshes import make_procedural_mesh

    tee = load_object(make_procedural_mesh("textured_asym", shape="tee"))
    renderer = make_renderer("cpu", "cpu")
    return {name: make_scenario(name, textured_object, renderer, frames=MIN_FRAMES, hw=(60, 80), seed=7,
                                distractor=tee) for name in SCENARIOS}


def test_every_event_ends_early_enough_for_a_1s_window_in_the_default_length(short_scenarios) -> None:
    assert OBSERVE_FRAMES >= FPS + 1 + 6 and DEFAULT_FRAMES == EVENTS_END + OBSERVE_FRAMES
    for name, sc in short_scenarios.items():
        visible = np.array([f.visible_fraction for f in sc.frames])
        hidden = np.flatnonzero(visible < 0.5)
        back = hidden.max() + 1 if len(hidden) else 0  # the object is in view from here on
        assert back < EVENTS_END, name
        # a reappearance at `back` needs frames back .. back + 30 (1 s at 30 frames/s) and a margin
        assert DEFAULT_FRAMES - 1 - back >= FPS + 6, name
        assert sc.fps == FPS and sc.seed == 7
    assert short_scenarios["jump"].events["jump"] < EVENTS_END
    assert short_scenarios["distractor"].events["gone"] == [10, 18]
    assert max(short_scenarios["leave"].events["gone"]) < EVENTS_END


def test_scenarios_carry_the_sensor_effects(short_scenarios, textured_object) -> None:
    from foundationpose.render import make_renderer

    sc = short_scenarios["clean"]
    assert sc.colour == {"kind": "sensor", "noise_std": 2.0} and sc.depth["bias_max"] == 0.002
    exact = make_scenario("clean", textured_object, make_renderer("cpu", "cpu"), frames=MIN_FRAMES, hw=(60, 80),
                          seed=7, depth=None, colour=None)
    assert exact.colour == {"kind": "exact"} and exact.depth == {"kind": "exact"}
    rgb_noise = np.stack([f.rgb.astype(np.float64) - e.rgb for f, e in zip(sc.frames, exact.frames, strict=True)])
    assert rgb_noise.std() == pytest.approx(2.0, rel=0.1)  # the colour noise, nothing else
    for f, e in zip(sc.frames[:5], exact.frames[:5], strict=True):  # flying pixels only where the depth jumps
        edge, near, far = depth_edges(e.depth, 0.02)
        flying = (f.depth > 0) & (np.abs(f.depth - e.depth) > 0.01)  # far beyond noise, bias and quantisation
        assert flying.any() and (flying <= edge).all()
        assert ((f.depth[flying] > near[flying]) & (f.depth[flying] < far[flying] * 1.003)).all()
    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -1"):
        make_scenario("clean", textured_object, make_renderer("cpu", "cpu"), seed=-1)
