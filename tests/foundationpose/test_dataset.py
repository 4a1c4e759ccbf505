"""RecordedSequence: the bundled demo sequence and the error cases of the official layout (spec §7.1)."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from foundationpose.demo.dataset import DatasetError, Frame, RecordedSequence, read_depth, read_mask, read_rgb
from foundationpose.errors import InputError, PoseError

BUNDLED = Path(__file__).resolve().parents[2] / "foundationpose" / "data" / "demo_sequence"
DEMO_K = np.array(
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)


def make_sequence(root: Path, n: int = 2, hw: tuple[int, int] = (8, 10)) -> Path:
    """A tiny valid sequence: cam_K.txt, rgb/, depth/ (mm), masks/ for every frame."""
    h, w = hw
    for sub in ("rgb", "depth", "masks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    np.savetxt(root / "cam_K.txt", [[50.0, 0.0, w / 2], [0.0, 50.0, h / 2], [0.0, 0.0, 1.0]])
    for i in range(n):
        fid = f"{i:04d}"
        cv2.imwrite(str(root / "rgb" / f"{fid}.png"), np.full((h, w, 3), 40 + i, np.uint8))
        cv2.imwrite(str(root / "depth" / f"{fid}.png"), np.full((h, w), 500 + i, np.uint16))
        mask = np.zeros((h, w), np.uint8)
        mask[2:5, 3:7] = 255
        cv2.imwrite(str(root / "masks" / f"{fid}.png"), mask)
    return root


# -- the bundled sequence --------------------------------------------------------------------------


def test_bundled_sequence_layout_and_values():
    seq = RecordedSequence(BUNDLED)
    assert len(seq) == 40
    assert seq.ids == sorted(seq.ids) and seq.ids[0] == "000000"
    np.testing.assert_array_equal(seq.K, DEMO_K)
    assert seq.image_hw == (480, 640)
    assert seq.mesh_path is not None and seq.mesh_path.name == "textured_simple.obj"
    assert seq.has_ground_truth

    frame = seq[0]
    assert isinstance(frame, Frame) and frame.id == "000000"
    assert frame.rgb.dtype == np.uint8 and frame.rgb.shape == (480, 640, 3)
    assert frame.depth.dtype == np.float32 and frame.depth.shape == (480, 640)
    assert frame.mask is not None and frame.mask.dtype == np.bool_ and frame.mask.sum() > 1000
    raw = cv2.imread(str(BUNDLED / "depth" / "000000.png"), cv2.IMREAD_UNCHANGED)
    assert raw.dtype == np.uint16
    np.testing.assert_array_equal(frame.depth, (raw.astype(np.float64) / 1000.0).astype(np.float32))
    # object nearer than the background plane; every pixel has a reading
    assert 0.4 < float(np.median(frame.depth[frame.mask])) < 0.7 < float(frame.depth[~frame.mask].min())
    bgr = cv2.imread(str(BUNDLED / "rgb" / "000000.png"))
    np.testing.assert_array_equal(frame.rgb, bgr[:, :, ::-1])

    pose = frame.gt_pose
    assert pose is not None and pose.shape == (4, 4)
    np.testing.assert_allclose(pose[:3, :3] @ pose[:3, :3].T, np.eye(3), atol=1e-6)
    # the ground-truth pose puts the object where the mask is: its mesh origin projects near the mask
    uvw = DEMO_K @ pose[:3, 3]
    rows, cols = np.nonzero(frame.mask)
    assert abs(uvw[0] / uvw[2] - cols.mean()) < 40 and abs(uvw[1] / uvw[2] - rows.mean()) < 40


def test_max_frames_and_iteration():
    seq = RecordedSequence(BUNDLED, max_frames=3)
    frames = list(seq)
    assert [f.id for f in frames] == ["000000", "000001", "000002"]
    assert all(f.gt_pose is not None and f.mask is not None for f in frames)
    assert not np.array_equal(frames[0].gt_pose, frames[2].gt_pose)


def test_scene_path_containing_rgb_is_fine(tmp_path):
    # the reference derives depth paths by replacing "rgb" anywhere in the path; we derive them by id
    seq = RecordedSequence(make_sequence(tmp_path / "rgb_scene_rgb"))
    frame = seq[1]
    np.testing.assert_array_equal(frame.depth, np.float32(0.501))
    assert frame.rgb[0, 0].tolist() == [41, 41, 41]
    assert seq.mesh_path is None and not seq.has_ground_truth and frame.gt_pose is None


# -- per-image conversions -------------------------------------------------------------------------


def test_rgb_alpha_dropped_and_bgr_converted(tmp_path):
    bgra = np.zeros((4, 5, 4), np.uint8)
    bgra[..., 0], bgra[..., 1], bgra[..., 2], bgra[..., 3] = 10, 20, 30, 128  # B, G, R, A
    cv2.imwrite(str(tmp_path / "a.png"), bgra)
    rgb = read_rgb(tmp_path / "a.png")
    assert rgb.shape == (4, 5, 3) and rgb[0, 0].tolist() == [30, 20, 10]


def test_depth_metres_and_invalid_zero(tmp_path):
    cv2.imwrite(str(tmp_path / "d.png"), np.array([[0, 1, 999, 65535]], np.uint16))
    depth = read_depth(tmp_path / "d.png")
    assert depth.dtype == np.float32
    np.testing.assert_array_equal(depth, np.array([[0.0, 0.001, 0.999, 65.535]], np.float32))


def test_mask_channel_rule(tmp_path):
    bgr = np.zeros((4, 5, 3), np.uint8)
    bgr[1, 1, 1] = 255  # only the G channel (OpenCV index 1) is set
    bgr[2, 2, 2] = 255  # R channel, ignored because G is the first non-empty one
    cv2.imwrite(str(tmp_path / "m.png"), bgr)
    mask = read_mask(tmp_path / "m.png")
    assert mask.dtype == np.bool_ and mask.sum() == 1 and mask[1, 1]
    bgr[0, 0, 0] = 1  # now B is non-empty and wins
    cv2.imwrite(str(tmp_path / "m.png"), bgr)
    assert np.argwhere(read_mask(tmp_path / "m.png")).tolist() == [[0, 0]]


# -- errors ----------------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(DatasetError, match=r"^data: expected a sequence folder .*no such folder"):
        RecordedSequence(tmp_path / "nope")


def test_errors_are_pose_errors():
    assert issubclass(DatasetError, InputError) and issubclass(DatasetError, PoseError)


def test_missing_depth_frame(tmp_path):
    root = make_sequence(tmp_path / "s", n=3)
    (root / "depth" / "0001.png").unlink()
    with pytest.raises(DatasetError, match=r"^depth/: expected one depth/<id>.png .*no depth/<id>.png for 0001"):
        RecordedSequence(root)


def test_extra_depth_frame(tmp_path):
    root = make_sequence(tmp_path / "s", n=2)
    cv2.imwrite(str(root / "depth" / "0009.png"), np.zeros((8, 10), np.uint16))
    with pytest.raises(DatasetError, match=r"^depth/: .*depth without rgb for 0009"):
        RecordedSequence(root)


def test_no_frames(tmp_path):
    root = make_sequence(tmp_path / "s", n=0)
    with pytest.raises(DatasetError, match=r"^rgb/: expected at least one image"):
        RecordedSequence(root)


def test_missing_first_mask(tmp_path):
    root = make_sequence(tmp_path / "s")
    (root / "masks" / "0000.png").unlink()
    with pytest.raises(DatasetError, match=r"^masks/0000.png: expected the first frame's object mask"):
        RecordedSequence(root)


def test_size_mismatch(tmp_path):
    root = make_sequence(tmp_path / "s")
    cv2.imwrite(str(root / "depth" / "0000.png"), np.full((8, 12), 500, np.uint16))
    with pytest.raises(DatasetError, match=r"^depth/0000.png: expected the size of its rgb image, 10x8 px; got 12x8 px"):
        RecordedSequence(root)


def test_size_mismatch_later_frame_raises_on_read(tmp_path):
    root = make_sequence(tmp_path / "s")
    cv2.imwrite(str(root / "depth" / "0001.png"), np.full((6, 10), 500, np.uint16))
    seq = RecordedSequence(root)  # only frame 0 is read up front
    with pytest.raises(DatasetError, match=r"^depth/0001.png: expected the size of its rgb image"):
        seq[1]


def test_8bit_depth(tmp_path):
    root = make_sequence(tmp_path / "s")
    cv2.imwrite(str(root / "depth" / "0000.png"), np.full((8, 10), 50, np.uint8))
    with pytest.raises(DatasetError, match=r"^depth/0000.png: expected a 16-bit single-channel PNG .*got uint8"):
        RecordedSequence(root)


@pytest.mark.parametrize(
    "text, match",
    [
        ("1 0 5\n0 1 4\n", r"^cam_K.txt: expected 3 lines of 3 whitespace-separated numbers; got 2 non-empty"),
        ("1 0 5\n0 1 4\n0 0 x\n", r"^cam_K.txt: expected 3 lines .*non-numeric"),
        ("1 0 5\n0 0 4\n0 0 1\n", r"^cam_K.txt: expected \[\[fx, s, cx\]"),
        ("1 0 5\n0 1 4\n0 0 nan\n", r"^cam_K.txt: expected finite numbers"),
    ],
)
def test_bad_cam_K(tmp_path, text, match):
    root = make_sequence(tmp_path / "s")
    (root / "cam_K.txt").write_text(text)
    with pytest.raises(DatasetError, match=match):
        RecordedSequence(root)


def test_missing_cam_K(tmp_path):
    root = make_sequence(tmp_path / "s")
    (root / "cam_K.txt").unlink()
    with pytest.raises(DatasetError, match=r"^cam_K.txt: expected an existing text file; got no such file"):
        RecordedSequence(root)


def test_bad_ground_truth_pose(tmp_path):
    root = make_sequence(tmp_path / "s")
    (root / "annotated_poses").mkdir()
    (root / "annotated_poses" / "0000.txt").write_text("1 0 0 0\n0 1 0 0\n0 0 1 0\n")
    with pytest.raises(DatasetError, match=r"^annotated_poses/0000.txt: expected 4 lines"):
        RecordedSequence(root)


def test_bundled_ground_truth_reproduces_the_frame():
    # rendering the mesh at the ground-truth pose (pixel-centre-exact, as the generator does) gives back the
    # mask and depth; tolerances leave room for renderer changes at silhouette pixels
    import torch

    from foundationpose.mesh import load_object
    from foundationpose.render import make_renderer

    seq = RecordedSequence(BUNDLED, max_frames=1)
    frame = seq[0]
    obj = load_object(seq.mesh_path)
    cam_from_centred = frame.gt_pose @ obj.mesh_from_centred
    out = make_renderer("cpu", "cpu").render_full_frame(
        obj.tensors, torch.as_tensor(cam_from_centred[None], dtype=torch.float32), seq.K, seq.image_hw,
        pixel_centre_exact=True,
    )
    mask = out.mask[0].numpy()
    iou = (mask & frame.mask).sum() / (mask | frame.mask).sum()
    assert iou > 0.99, iou
    both = mask & frame.mask
    depth_err = np.abs(out.xyz_cam[0, :, :, 2].numpy()[both] - frame.depth[both])
    assert np.median(depth_err) <= 0.0005 + 1e-6  # millimetre quantisation of the PNG
