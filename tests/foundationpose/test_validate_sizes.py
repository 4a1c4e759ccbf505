"""foundationpose.validate's check that a frame's images are of one size: it names the odd image (by the others and
K), says which image is which size and names the dtype received."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose.errors import InputError
from foundationpose.validate import check_image_sizes, register_request, track_request

BIG, SMALL = (480, 640), (240, 320)


def _K(hw: tuple[int, int]) -> np.ndarray:
    h, w = hw
    return np.array([[0.9 * w, 0.0, (w - 1) / 2], [0.0, 0.9 * w, (h - 1) / 2], [0.0, 0.0, 1.0]])


def _rgb(hw):
    return np.zeros((*hw, 3), np.uint8)


def _depth(hw, dtype=np.float32):
    return np.full(hw, 0.5, dtype)


def _mask(hw):
    mask = np.zeros(hw, np.uint8)
    mask[10:20, 10:20] = 1
    return mask


def test_a_resized_rgb_is_named_when_depth_mask_and_K_agree():
    with pytest.raises(InputError) as info:
        register_request(_rgb(SMALL), _depth(BIG), _mask(BIG), _K(BIG))
    assert info.value.field == "rgb"
    assert str(info.value) == (
        "rgb: expected the size of depth, mask and K, 480x640 (HxW); got a 240x320 uint8 array. rgb is 240x320 "
        "while depth and mask are 480x640: send every image at one size (resize them together, and scale K with them)")


def test_a_track_names_the_rgb_when_K_is_of_the_depths_size():
    with pytest.raises(InputError, match=r"^rgb: expected the size of depth and K, 480x640 \(HxW\); got a 240x320 "
                                         r"uint8 array\. rgb is 240x320 while depth is 480x640: "):
        track_request(_rgb(SMALL), _depth(BIG), _K(BIG), np.eye(4))


def test_the_depth_is_named_with_its_dtype_when_rgb_and_K_agree():
    with pytest.raises(InputError, match=r"^depth: expected the size of rgb and K, 240x320 \(HxW\); got a 480x640 "
                                         r"float64 array\. depth is 480x640 while rgb is 240x320: "):
        track_request(_rgb(SMALL), _depth(BIG, np.float64), _K(SMALL), np.eye(4))


def test_without_a_telling_K_the_rgb_sets_the_size_and_both_sizes_are_stated():
    for K in (None, np.zeros(9), _K((300, 400))):  # none, not a 3x3, near the centre of neither size
        with pytest.raises(InputError, match=r"^depth: expected the size of rgb, 240x320 \(HxW\); got a 480x640 "
                                             r"float32 array\. depth is 480x640 while rgb is 240x320: "):
            check_image_sizes(_rgb(SMALL), _depth(BIG), None, K)


def test_a_mask_of_another_size_is_named_and_tensors_are_described():
    with pytest.raises(InputError, match=r"^mask: expected the size of rgb and depth, 480x640 \(HxW\); got a "
                                         r"480x641 bool array\. mask is 480x641 while rgb and depth are 480x640: "):
        register_request(_rgb(BIG), torch.from_numpy(_depth(BIG)), np.ones((480, 641), bool), _K(BIG))
    with pytest.raises(InputError, match=r"^depth: .*got a 240x320 float32 array\. "):
        check_image_sizes(_rgb(BIG), torch.from_numpy(_depth(SMALL)), None, _K(BIG))


def test_received_descriptions_replace_the_decoded_dtype():
    with pytest.raises(InputError, match=r"^depth: .*got a 480x640 16-bit PNG \(uint16 millimetres\)\. "):
        check_image_sizes(_rgb(SMALL), _depth(BIG), None, None, received={"depth": "16-bit PNG (uint16 millimetres)"})


def test_images_of_one_size_pass_and_a_valid_request_is_unchanged():
    check_image_sizes(_rgb(BIG), _depth(BIG), _mask(BIG), _K(SMALL))  # K's own check is validate_K's
    check_image_sizes(_rgb(BIG), np.zeros(7), None, None)  # not an image: validate_depth reports it
    request = register_request(_rgb(BIG), _depth(BIG), _mask(BIG), _K(BIG))
    assert request.depth.shape == BIG and request.mask.shape == BIG
