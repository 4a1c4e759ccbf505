"""Edge validation shared by the API, the server and the demo (style guide "Validation at the edges")."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from foundationpose.errors import InputError
from foundationpose.validate import (
    MIN_FARTHEST_DEPTH_M,
    InputLimits,
    RegisterRequest,
    TrackRequest,
    depth_in_range,
    masked_depth_count,
    register_request,
    require_masked_depth_count,
    track_request,
    validate_depth,
    validate_K,
    validate_mask,
    validate_pose,
    validate_rgb,
)

HW = (6, 8)
K_GOOD = np.array([[500.0, 0.0, 4.0], [0.0, 510.0, 3.0], [0.0, 0.0, 1.0]])


# ------------------------------------------------------------------------------------------------- rgb


def test_rgb_passes_uint8_and_tensors() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, size=(*HW, 3), dtype=np.uint8)
    np.testing.assert_array_equal(validate_rgb(rgb), rgb)
    np.testing.assert_array_equal(validate_rgb(torch.from_numpy(rgb)), rgb)
    assert validate_rgb(rgb[:, ::-1]).flags.c_contiguous


def test_rgb_float_gets_a_hint() -> None:
    with pytest.raises(
        InputError, match=r"^rgb: expected uint8 \(H, W, 3\) RGB; got float32 \(6, 8, 3\)\. Float image"
    ) as info:
        validate_rgb(np.zeros((*HW, 3), np.float32))
    assert info.value.field == "rgb"


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (np.zeros((*HW, 4), np.uint8), r"^rgb: .*got uint8 \(6, 8, 4\)\. Drop the alpha channel"),
        (np.zeros(HW, np.uint8), r"^rgb: .*got uint8 \(6, 8\)$"),
        (None, r"^rgb: .*got NoneType$"),
        ("image.png", r"^rgb: .*got str$"),
    ],
)
def test_rgb_rejects_bad_shapes(value: object, pattern: str) -> None:
    with pytest.raises(InputError, match=pattern):
        validate_rgb(value)


# ----------------------------------------------------------------------------------------------- depth


def test_depth_float_metres_pass_and_become_float32() -> None:
    depth = np.full(HW, 0.6, dtype=np.float64)
    out = validate_depth(depth, HW)
    assert out.dtype == np.float32 and out.shape == HW and np.all(out == np.float32(0.6))
    assert out is not depth
    assert validate_depth(depth[..., None], HW).shape == HW


def test_depth_nan_and_inf_become_zero_without_touching_the_input() -> None:
    depth = np.full(HW, 0.6, dtype=np.float32)
    depth[0, 0], depth[1, 1] = np.nan, np.inf
    out = validate_depth(depth, HW)
    assert out[0, 0] == 0.0 and out[1, 1] == 0.0 and out[2, 2] == np.float32(0.6)
    assert np.isnan(depth[0, 0])


def test_depth_in_range_is_the_common_case_validate_depth_returns_as_it_is() -> None:
    """depth_in_range: finite, >= 0, <= MAX_MEDIAN_DEPTH_M everywhere. in_range=True (an ingest worker found it so)
    skips the value checks of an owned float32 array only; any other array is still checked."""
    from foundationpose.validate import MAX_MEDIAN_DEPTH_M, depth_in_range

    plain = np.full(HW, 0.6, dtype=np.float32)
    plain[0, 0] = 0.0
    assert depth_in_range(plain) and validate_depth(plain, HW, owned=True, in_range=True) is plain
    for bad in (np.nan, np.inf, -0.1, MAX_MEDIAN_DEPTH_M * 1.01):
        odd = plain.copy()
        odd[1, 1] = bad
        assert not depth_in_range(odd), bad
    negative = plain.copy()
    negative[2, 2] = -0.1
    with pytest.raises(InputError, match=r"^depth: expected non-negative"):  # not owned: copied, then checked
        validate_depth(negative, HW, in_range=True)
    with pytest.raises(InputError, match=r"^depth: expected float32 metres"):  # type and shape: always checked
        validate_depth(plain[:, :1], HW, owned=True, in_range=True)


def test_owned_depth_is_checked_in_place_only_when_it_can_be() -> None:
    """owned=True: a writeable C-contiguous float32 array is returned itself (NaN / inf zeroed in it); anything
    else (read-only, strided, float64) is still copied, and the verdicts are the copying path's."""
    depth = np.full(HW, 0.6, dtype=np.float32)
    depth[0, 0], depth[1, 1] = np.nan, np.inf
    want = validate_depth(depth, HW)
    got = validate_depth(depth, HW, owned=True)
    assert got is depth and np.array_equal(got, want) and depth[0, 0] == 0.0
    read_only = np.full(HW, 0.6, dtype=np.float32)
    read_only.flags.writeable = False
    assert validate_depth(read_only, HW, owned=True) is not read_only
    wide = np.full((HW[0], 2 * HW[1]), 0.6, dtype=np.float32)[:, ::2]
    assert validate_depth(wide, HW, owned=True) is not wide
    assert validate_depth(np.full(HW, 0.6), HW, owned=True).dtype == np.float32  # float64: converted
    negative = np.full(HW, 0.6, dtype=np.float32)
    negative[2, 2] = -0.1
    with pytest.raises(InputError, match=r"^depth: expected non-negative"):
        validate_depth(negative, HW, owned=True)


@pytest.mark.parametrize(
    "specials",
    [{}, {(0, 0): np.nan}, {(0, 0): np.inf}, {(5, 7): np.nan, (1, 2): np.inf}, {(0, 0): np.nan, (3, 3): -0.2},
     {(0, 0): np.inf, (2, 2): -np.inf}, {(4, 4): -0.0}],
)
def test_depth_fast_check_answers_like_the_element_wise_rule(specials: dict) -> None:
    """min/max decide the common case; every mix of NaN, +-inf and negatives still gets the element-wise answer."""
    depth = np.linspace(0.3, 0.9, HW[0] * HW[1], dtype=np.float32).reshape(HW)
    for at, value in specials.items():
        depth[at] = value
    negative = bool(np.any(depth < 0) or np.any(depth == -np.inf))
    if negative:
        with pytest.raises(InputError, match=r"^depth: expected non-negative"):
            validate_depth(depth, HW)
        return
    expected = np.where(np.isfinite(depth), depth, np.float32(0.0))
    assert np.array_equal(validate_depth(depth, HW), expected)


def test_depth_uint16_millimetres_is_rejected_with_a_hint() -> None:
    with pytest.raises(
        InputError,
        match=r"^depth: expected float32 metres \(H, W\); got uint16 \(6, 8\)\. Millimetre depth\? Pass depth / 1000$",
    ):
        validate_depth(np.full(HW, 600, np.uint16), HW)


def test_depth_float_millimetres_is_rejected_with_a_hint() -> None:
    with pytest.raises(InputError, match=r"^depth: expected metres .*; got median 600\. Millimetre depth\?"):
        validate_depth(np.full(HW, 600.0, np.float32), HW)


def test_depth_unit_check_only_looks_at_the_median_when_the_maximum_is_far() -> None:
    """Depth whose maximum is within MAX_MEDIAN_DEPTH_M passes without a median; a few far readings (max above it,
    median below) pass too; a NaN-holed millimetre map still fails on its median."""
    from foundationpose.validate import MAX_MEDIAN_DEPTH_M

    near = np.full(HW, MAX_MEDIAN_DEPTH_M, np.float32)
    assert np.array_equal(validate_depth(near, HW), near)
    far_few = np.full(HW, 0.8, np.float32)
    far_few[1, :3] = 3 * MAX_MEDIAN_DEPTH_M  # off the every-7th-pixel sample of the unit check
    assert np.array_equal(validate_depth(far_few, HW), far_few)
    holed_mm = np.full(HW, 600.0, np.float32)
    holed_mm[1, 1] = np.nan
    with pytest.raises(InputError, match=r"^depth: expected metres .*; got median 600\. Millimetre depth\?"):
        validate_depth(holed_mm, HW)


def test_depth_negative_and_shape_mismatch_are_rejected() -> None:
    depth = np.full(HW, 0.5, np.float32)
    depth[0, 0] = -0.1
    with pytest.raises(
        InputError, match=r"^depth: expected non-negative metres \(0 = no reading\); got 1 negative values$"
    ):
        validate_depth(depth, HW)
    depth[0, 0] = -np.inf
    with pytest.raises(InputError, match=r"^depth: expected non-negative"):
        validate_depth(depth, HW)
    with pytest.raises(
        InputError,
        match=r"^depth: expected float32 metres \(H, W\) \(6, 8\) to match rgb; got float32 \(8, 6\)$",
    ):
        validate_depth(np.zeros((8, 6), np.float32), HW)


# ------------------------------------------------------------------------------------------------ mask


def test_mask_accepts_bool_uint8_and_float() -> None:
    mask = np.zeros(HW, np.uint8)
    mask[2:4, 3:5] = 255
    for value in (mask, mask > 0, mask.astype(np.float32) / 255, mask[..., None], torch.from_numpy(mask)):
        out = validate_mask(value, HW)
        assert out.dtype == np.bool_ and out.shape == HW and int(out.sum()) == 4


def test_mask_empty_multichannel_and_mismatch_are_rejected() -> None:
    with pytest.raises(InputError, match=r"^mask: expected at least one object pixel; got an empty mask$"):
        validate_mask(np.zeros(HW, bool), HW)
    with pytest.raises(InputError, match=r"^mask: .*got uint8 \(6, 8, 3\)\. Pass one channel"):
        validate_mask(np.ones((*HW, 3), np.uint8), HW)
    with pytest.raises(
        InputError, match=r"^mask: expected \(H, W\) \(6, 8\) to match rgb; got bool \(6, 9\)$"
    ):
        validate_mask(np.ones((6, 9), bool), HW)


# ------------------------------------------------------------------------------------------------- K


def test_K_passes_and_is_float64() -> None:
    out = validate_K(K_GOOD.astype(np.float32))
    assert out.dtype == np.float64 and out.shape == (3, 3)
    np.testing.assert_array_equal(out, K_GOOD.astype(np.float32).astype(np.float64))


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (K_GOOD.reshape(9), r"^K: .*got float64 \(9,\)\. Row-major flat K\? Pass K\.reshape\(3, 3\)$"),
        (np.eye(4), r"^K: .*got float64 \(4, 4\)$"),
        (
            K_GOOD * np.array([[1, 1, 1], [1, 1, 1], [1, 1, np.nan]]),
            r"^K: expected finite values; got NaN or inf$",
        ),
        (np.diag([-500.0, 500.0, 1.0]), r"^K: expected positive focal lengths .*; got fx=-500, fy=500$"),
        (K_GOOD.T, r"^K: expected last rows .*\. Transposed K\? Pass K\.T$"),
    ],
)
def test_K_rejections(value: np.ndarray, pattern: str) -> None:
    with pytest.raises(InputError, match=pattern):
        validate_K(value)


def test_K_with_skew_warns(caplog: pytest.LogCaptureFixture) -> None:
    K = K_GOOD.copy()
    K[0, 1] = 0.5
    with caplog.at_level(logging.WARNING, logger="foundationpose.validate"):
        validate_K(K)
    assert "skew" in caplog.text


# ------------------------------------------------------------------------------------------------ pose


def test_pose_passes_a_rigid_float32_transform() -> None:
    c, s = np.cos(0.3), np.sin(0.3)
    pose = np.array([[c, -s, 0, 0.1], [s, c, 0, -0.2], [0, 0, 1, 0.7], [0, 0, 0, 1]], dtype=np.float32)
    out = validate_pose(pose)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, pose.astype(np.float64))


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (np.eye(3), r"^pose: expected a rigid \(4, 4\) transform .*; got float64 \(3, 3\)$"),
        (
            np.diag([1.0, 1.0, 1.0, 2.0]),
            r"^pose: expected bottom row \[0, 0, 0, 1\]; got \[0\.0, 0\.0, 0\.0, 2\.0\]$",
        ),
        (np.diag([1.0, 1.0, -1.0, 1.0]), r"^pose: expected a rotation .*det = -1$"),
        (np.diag([1.0, 2.0, 1.0, 1.0]), r"^pose: expected a rotation .*; got max \|R\^T R - I\| = 3"),
        (np.full((4, 4), np.inf), r"^pose: expected finite values; got NaN or inf$"),
    ],
)
def test_pose_rejections(value: np.ndarray, pattern: str) -> None:
    with pytest.raises(InputError, match=pattern):
        validate_pose(value)


def test_pose_field_name_is_configurable() -> None:
    with pytest.raises(InputError, match=r"^initial_pose: "):
        validate_pose(np.eye(3), field="initial_pose")


# -------------------------------------------------------------------------------------- masked depth


def test_masked_depth_needs_four_valid_pixels() -> None:
    depth = np.zeros(HW, np.float32)
    mask = np.zeros(HW, bool)
    mask[1:3, 1:3] = True
    depth[1, 1] = depth[1, 2] = depth[2, 1] = 0.5
    depth[2, 2] = 0.0009  # below 1 mm: not valid
    depth[5, 5] = 0.5  # valid but outside the mask
    count = masked_depth_count(torch.from_numpy(depth), torch.from_numpy(mask))
    assert count.dtype == torch.int64 and count.ndim == 0 and int(count) == 3
    with pytest.raises(
        InputError,
        match=r"^depth: expected at least 4 valid depth pixels \(>= 0\.001 m\) under the mask; got 3\. Check",
    ) as info:
        require_masked_depth_count(int(count))
    assert info.value.field == "depth" and info.value.got == "3"
    depth[2, 2] = np.float32(0.001)  # exactly 1 mm (float32) counts
    count = int(masked_depth_count(torch.from_numpy(depth), torch.from_numpy(mask)))
    assert require_masked_depth_count(count) == 4


def test_masked_depth_count_compares_in_float32_like_numpy() -> None:
    rng = np.random.default_rng(3)
    depth = rng.uniform(0.0, 0.003, HW).astype(np.float32)
    depth[0, 0] = np.float32(0.001)  # the boundary counts
    mask = rng.random(HW) > 0.3
    mask[0, 0] = True
    host = int(np.count_nonzero((depth >= np.float32(0.001)) & mask))
    assert int(masked_depth_count(torch.from_numpy(depth), torch.from_numpy(mask))) == host


# ---------------------------------------------------------------------------------- plausible K


@pytest.mark.parametrize(
    ("entry", "value", "pattern"),
    [
        ((0, 0), 1e300, r"^K: expected focal lengths fx, fy in pixels between 0\.08 and 800 for a 8x6 image; got fx=1e\+300"),
        ((0, 0), 1e-300, r"^K: expected focal lengths .*; got fx=1e-300, fy=510\. K in pixels of this image\?"),
        ((1, 1), 0.05, r"^K: expected focal lengths .*; got fx=500, fy=0\.05"),
        ((0, 2), 1e308, r"^K: expected the principal point \(cx, cy\) inside the 8x6 image \(0 < cx < 8, "
                        r"0 < cy < 6\); got cx=1e\+308, cy=3\. K for another image size\?$"),
        ((0, 2), 8.0, r"^K: expected the principal point .*; got cx=8, cy=3\. K for another image size\? \(cx, cy\) "
                      r"is the centre of a 16x6 image$"),
        ((1, 2), -3.5, r"^K: expected the principal point .*; got cx=4, cy=-3\.5"),
    ],
)
def test_K_must_be_plausible_for_the_image(entry: tuple[int, int], value: float, pattern: str) -> None:
    """The principal point must lie inside the image: a K of a 1920x1080 camera sent with a 640x480 frame (or
    cx = W) is refused with a hint instead of tracked with wrong rays."""
    K = K_GOOD.copy()
    K[entry] = value
    validate_K(K)  # without an image size only the absolute rules apply
    with pytest.raises(InputError, match=pattern) as info:
        validate_K(K, HW)
    assert info.value.field == "K"


def test_K_at_the_edges_of_the_plausible_range_passes() -> None:
    K = np.array([[800.0, 0.0, 7.9], [0.0, 0.08, 0.1], [0.0, 0.0, 1.0]])  # 100 L, L / 100, cx, cy near the edges
    np.testing.assert_array_equal(validate_K(K, HW), K)


# ---------------------------------------------------------------------------------- working range


def test_pose_translation_must_lie_in_the_working_range() -> None:
    pose = np.eye(4)
    pose[:3, 3] = (0.0, 0.0, 1e30)
    with pytest.raises(InputError, match=r"^pose: expected a translation within the working range \|t\| <= 50 m; "
                                         r"got \|t\| = 1e\+30 m\. Translation in millimetres\?"):
        validate_pose(pose)
    pose[:3, 3] = (30.0, 0.0, 40.0)  # |t| = 50 exactly
    assert validate_pose(pose)[2, 3] == 40.0
    with pytest.raises(InputError, match=r"^pose: .*\|t\| <= 2 m; got \|t\| = 50 m"):
        validate_pose(pose, max_translation_m=2.0)
    assert validate_pose(pose, max_translation_m=None)[0, 3] == 30.0


# ------------------------------------------------------------------------------------- requests


def _frame(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, size=(*HW, 3), dtype=np.uint8)
    depth = rng.uniform(0.4, 0.6, HW)
    mask = np.zeros(HW, np.uint8)
    mask[1:4, 2:6] = 255
    return rgb, depth, mask


def test_register_request_is_frozen_and_normalised() -> None:
    rgb, depth, mask = _frame()
    request = register_request(rgb[:, ::-1], depth, mask, K_GOOD.astype(np.float32), iterations=np.int64(3))
    assert isinstance(request, RegisterRequest) and request.hw == HW
    assert request.rgb.dtype == np.uint8 and request.rgb.flags.c_contiguous
    np.testing.assert_array_equal(request.rgb, rgb[:, ::-1])
    assert request.depth.dtype == np.float32 and request.depth.flags.c_contiguous
    assert request.mask.dtype == np.bool_ and int(request.mask.sum()) == 12
    assert request.K.dtype == np.float64 and request.iterations == 3 and type(request.iterations) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.iterations = 1  # type: ignore[misc]


def test_track_request_is_frozen_and_normalised() -> None:
    rgb, depth, _ = _frame()
    pose = np.eye(4, dtype=np.float32)
    pose[2, 3] = 0.5
    request = track_request(rgb, depth, K_GOOD, pose, prev_frame="centred", iterations=1)
    assert isinstance(request, TrackRequest) and request.prev_frame == "centred" and request.iterations == 1
    assert request.prev_pose.dtype == np.float64 and request.prev_pose[2, 3] == np.float32(0.5)
    assert request.depth.dtype == np.float32 and request.K.dtype == np.float64
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.prev_frame = "mesh"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(iterations=0), r"^iterations: expected an int >= 1, or None; got 0$"),
        (dict(iterations=True), r"^iterations: expected an int >= 1, or None; got bool$"),
        (dict(iterations=2.0), r"^iterations: expected an int >= 1, or None; got float$"),
        (dict(limits=InputLimits(max_image_hw=(4, 8))), r"^rgb: expected an image of at most 4x8 pixels \(HxW\); got 6x8$"),
    ],
)
def test_register_request_rejections(kwargs: dict, pattern: str) -> None:
    rgb, depth, mask = _frame()
    with pytest.raises(InputError, match=pattern):
        register_request(rgb, depth, mask, K_GOOD, **kwargs)


def test_requests_check_fields_in_order_and_apply_the_limits() -> None:
    rgb, depth, mask = _frame()
    bad_K = K_GOOD.copy()
    bad_K[0, 0] = 1e300
    with pytest.raises(InputError, match=r"^mask: "):  # mask before K, as the form's fields
        register_request(rgb, depth, np.zeros(HW, bool), bad_K)
    with pytest.raises(InputError, match=r"^K: expected focal lengths"):
        register_request(rgb, depth, mask, bad_K)
    far = np.eye(4)
    far[2, 3] = 3.0
    with pytest.raises(InputError, match=r"^pose: .*\|t\| <= 2 m"):
        track_request(rgb, depth, K_GOOD, far, limits=InputLimits(max_translation_m=2.0))
    assert track_request(rgb, depth, K_GOOD, far).prev_pose[2, 3] == 3.0
    with pytest.raises(InputError, match=r"^prev_frame: expected 'mesh' or 'centred'; got 'world'$"):
        track_request(rgb, depth, K_GOOD, far, prev_frame="world")


@pytest.mark.parametrize("value", [0.0, -0.0, 0.6, 50.0, np.nextafter(np.float32(50.0), np.float32(100.0)), -1e-30,
                                   1e-45, np.nan, -np.nan, np.inf, -np.inf, 1e30])
def test_the_one_reduction_range_test_never_accepts_what_the_two_reduction_rule_refuses(value: float) -> None:
    """_float32_in_range (the largest bit pattern) is sufficient for _bounds_in_range (min >= 0, max <= the limit):
    True only where the rule says True; where it says False the callers ask the rule itself (-0.0 is the one value
    the rule accepts that it does not)."""
    from foundationpose.validate import _bounds_in_range, _float32_in_range, depth_in_range

    depth = np.full(HW, 0.6, dtype=np.float32)
    depth[3, 4] = value
    rule = _bounds_in_range(depth.min(), depth.max())
    fast = _float32_in_range(depth)
    assert not fast or rule, value
    assert fast == rule or np.signbit(np.float32(value)) and np.float32(value) == 0, value
    assert depth_in_range(depth) == rule  # the public test falls back to the rule


def test_borrowed_depth_is_returned_as_it_is_only_when_nothing_needs_fixing() -> None:
    """borrow=True (a track request staged right away): an in-range float32 map is the caller's array itself; a map
    with NaN is copied and fixed in the copy, never in the caller's array; a negative one is refused as usual."""
    depth = np.full(HW, 0.6, dtype=np.float32)
    assert validate_depth(depth, HW, borrow=True) is depth
    holes = depth.copy()
    holes[1, 1] = np.nan
    fixed = validate_depth(holes, HW, borrow=True)
    assert fixed is not holes and fixed[1, 1] == 0.0 and np.isnan(holes[1, 1])
    assert validate_depth(depth.astype(np.float64), HW, borrow=True).dtype == np.float32  # other dtypes: converted
    negative = depth.copy()
    negative[2, 2] = -0.1
    with pytest.raises(InputError, match=r"^depth: expected non-negative"):
        validate_depth(negative, HW, borrow=True)


def test_the_pose_checks_python_floats_agree_with_their_numpy_twin() -> None:
    """``_rigid_numbers`` (Python floats, the hot path) against ``_rigid_numbers_reference`` (NumPy): the same
    orthonormality error, determinant and distance on rigid, scaled, sheared, reflected and non-finite poses."""
    from scipy.spatial.transform import Rotation

    from foundationpose.validate import _rigid_numbers, _rigid_numbers_reference

    rng = np.random.default_rng(7)
    poses = []
    for i in range(300):
        pose = np.eye(4)
        pose[:3, :3] = Rotation.random(random_state=i).as_matrix()
        pose[:3, 3] = rng.normal(0, 2, 3)
        if i % 4 == 1:
            pose[:3, :3] *= 1 + rng.normal(0, 1e-3)  # scaled
        elif i % 4 == 2:
            pose[rng.integers(3), rng.integers(3)] += rng.normal(0, 1e-2)  # sheared
        elif i % 4 == 3:
            pose[:3, 0] *= -1  # a reflection: det -1
        poses.append(pose)
    for pose in poses:
        fast, ref = _rigid_numbers(pose), _rigid_numbers_reference(pose)
        assert fast[3] and ref[3]
        np.testing.assert_allclose(fast[:3], ref[:3], rtol=1e-12, atol=1e-14)
    for bad in (np.nan, np.inf, -np.inf):
        pose = np.eye(4)
        pose[1, 3] = bad
        assert _rigid_numbers(pose)[3] is False and _rigid_numbers_reference(pose)[3] is False
    # and the decisions of validate_pose follow them: a reflection and a scale are refused, with their numbers
    reflected = poses[3]
    with pytest.raises(InputError, match=r"det = -1"):
        validate_pose(reflected)


def test_a_full_hd_k_with_a_vga_frame_is_refused_with_its_size_named() -> None:
    full_hd = np.array([[1066.0, 0.0, 960.0], [0.0, 1066.0, 540.0], [0.0, 0.0, 1.0]])
    with pytest.raises(InputError, match=r"^K: expected the principal point \(cx, cy\) inside the 640x480 image .*"
                                         r"got cx=960, cy=540\. K for another image size\? \(cx, cy\) is the centre "
                                         r"of a 1920x1080 image$"):
        validate_K(full_hd, (480, 640))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_metres_written_as_millimetres_are_refused_with_a_hint(dtype) -> None:
    """A 16-bit depth PNG written in metres decodes to readings of 1-2 mm: refused (it would answer a pose behind
    the camera), on the one-reduction path and on the exact one, NaN readings included."""
    depth = np.zeros((6, 8), dtype)
    depth[2:4, 3:6] = 0.001 * np.arange(1, 7).reshape(2, 3) / 3 + 0.001  # 1-3 mm
    assert not depth_in_range(depth)
    with pytest.raises(InputError, match=r"^depth: expected metres, the farthest reading at least 0\.02 m; got every "
                                         r"reading within 3 mm of the camera\. Depth in metres saved as millimetres\?"):
        validate_depth(depth)
    depth[0, 0] = np.nan
    with pytest.raises(InputError, match=r"^depth: expected metres, the farthest reading"):
        validate_depth(depth)
    empty = np.zeros((6, 8), dtype)  # no reading at all is a depth map (the register then says so)
    assert depth_in_range(empty) and not validate_depth(empty).any()
    depth[0, 0] = MIN_FARTHEST_DEPTH_M  # one reading as far as 2 cm: a plausible (close-range) map
    assert depth_in_range(depth) and validate_depth(depth).dtype == np.float32
