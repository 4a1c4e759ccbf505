"""Image codecs: encoded rgb, depth and mask files to the arrays the pipeline takes (and back, for clients).

Formats, detected by content (magic bytes), never by file name:

* ``rgb``: PNG or JPEG, 8 bits per channel, colour (grey, alpha and palette PNGs are converted) ->
  ``(H, W, 3) uint8`` in **RGB** order.
* ``depth``: 16-bit single-channel PNG in **millimetres** (0 = no reading) -> float32 metres
  (``mm / 1000``); or ``.npy`` (NumPy format) float array in **metres** (NaN / 0 = no reading).
* ``mask``: single-channel PNG (1, 8 or 16 bit, or palette indices); > 0 = object.

Pixels are decoded once, with no second pass: an 8-bit RGB / RGBA PNG and a 16-bit depth PNG by
``imagecodecs`` (libpng with a faster inflate: 4.5 ms against OpenCV's 5.0 ms for a 640x480 rgb PNG on
the development machine; the optional ``server`` extra) when it is installed, every other image by OpenCV straight into RGB order
(``IMREAD_COLOR_RGB``); both release the GIL while they decode. Millimetres become metres in one
pass (:func:`depth_m_from_mm`). :func:`rgb_pixels_reference` / :func:`depth_pixels_reference` are the
plain twins (OpenCV BGR + ``cvtColor``; ``astype`` then divide) the fast paths are tested against.

Image sizes are read from the header and checked against the server's maximum *before* the pixels
are decoded (a small file cannot expand into a huge image; an image Pillow refuses as a decompression
bomb is a size error too). ``.npy`` headers are read defensively: an allow-list of dtypes, and the
declared size checked against the body before anything is allocated. Failures raise ``InputError``
naming the field (422) or ``ImageTooLargeError`` (413). Value rules (shapes, dtypes, finiteness,
units, plausible K and poses) are ``foundationpose.validate``'s, applied once to the whole request;
this module only turns bytes into arrays.
"""

from __future__ import annotations

import io
import struct

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

try:  # optional (the server extra): a faster PNG decoder for the common colour and depth PNGs
    import imagecodecs as _imagecodecs
except ImportError:  # pragma: no cover - OpenCV decodes everything then
    _imagecodecs = None

from foundationpose.errors import InputError
from foundationpose.validate import depth_in_range
from server.errors import ImageTooLargeError
from server.fields import EXPECTED

__all__ = [
    "FAST_PNG",
    "decode_depth",
    "decode_mask",
    "decode_rgb",
    "depth_m_from_mm",
    "depth_pixels_reference",
    "encode_depth_npy",
    "encode_depth_png_mm",
    "encode_mask_png",
    "encode_rgb_png",
    "mm_in_range",
    "open_image",
    "rgb_pixels_reference",
    "sniff",
]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JPEG_MAGIC = b"\xff\xd8\xff"
NPY_MAGIC = b"\x93NUMPY"
_PNG_COLOUR = {0: "grey", 2: "RGB", 3: "palette", 4: "grey+alpha", 6: "RGBA"}
_PIL_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error)
# .npy dtypes read at all: floats (metres), and integers / bools so that validation can say what is wrong
# (millimetres?) instead of "unreadable". Anything else (strings, objects, records, complex) is refused from
# the header, before its (possibly huge) declared size is looked at.
_NPY_KINDS = frozenset("fiub")
_NPY_MAX_ITEMSIZE = 8

FAST_PNG = bool(getattr(getattr(_imagecodecs, "PNG", None), "available", False))  # imagecodecs built with libpng
_PNG_COLOUR_RGB, _PNG_COLOUR_RGBA = 2, 6
_MM_PER_M = np.float32(1000.0)
_CV_RGB = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION  # as PIL: no EXIF turn

RGB_EXPECTED = EXPECTED["rgb"]
DEPTH_EXPECTED = EXPECTED["depth"]
MASK_EXPECTED = EXPECTED["mask"]


def sniff(data: bytes) -> str:
    """``"png"``, ``"jpeg"``, ``"npy"`` or ``"unknown"`` from the first bytes."""
    if data.startswith(PNG_MAGIC):
        return "png"
    if data.startswith(JPEG_MAGIC):
        return "jpeg"
    if data.startswith(NPY_MAGIC):
        return "npy"
    return "unknown"


def _png_header(data: bytes, field: str, expected: str) -> tuple[int, int, int, int]:
    """(width, height, bit depth, colour type) from a PNG's IHDR chunk."""
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise InputError(field, expected, "a truncated or corrupt PNG (no IHDR header)")
    width, height, bit_depth, colour = struct.unpack(">IIBB", data[16:26])
    return width, height, bit_depth, colour


def _limit_text(max_hw: tuple[int, int]) -> str:
    return f"an image of at most {max_hw[1]}x{max_hw[0]} pixels (WxH)"


def _check_size(field: str, height: int, width: int, max_hw: tuple[int, int]) -> None:
    max_h, max_w = max_hw
    if height > max_h or width > max_w:
        raise ImageTooLargeError(field, f"{field}: expected {_limit_text(max_hw)}; got {width}x{height}")
    if height < 1 or width < 1:
        raise InputError(field, "a non-empty image", f"{width}x{height} pixels")


def open_image(data: bytes, field: str, expected: str, limit: str) -> Image.Image:
    """Open (lazily: header only) an uploaded image. A header Pillow refuses as a decompression bomb
    is a size error (413, ``"<field>: expected <limit>; got ..."``), any other failure an input error (422)."""
    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        most = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        raise ImageTooLargeError(field, f"{field}: expected {limit}; got an image whose header claims more than "
                                        f"{most} pixels") from exc
    except _PIL_ERRORS as exc:
        raise InputError(field, expected, f"an undecodable image ({type(exc).__name__})") from exc


def _open(data: bytes, field: str, expected: str, max_hw: tuple[int, int]) -> Image.Image:
    """Open (lazily) and size-check an image; the pixels are decoded by the caller's ``load``."""
    image = open_image(data, field, expected, _limit_text(max_hw))
    width, height = image.size
    _check_size(field, height, width, max_hw)
    return image


def _load(image: Image.Image, field: str, expected: str, mode: str | None = None) -> np.ndarray:
    try:
        if mode is not None and image.mode != mode:
            image = image.convert(mode)
        return np.array(image)  # a writable copy (PIL's array interface gives read-only views)
    except Image.DecompressionBombError as exc:  # Pillow checks again when it decodes
        raise ImageTooLargeError(field, f"{field}: expected a smaller image; got one of {image.size[0]}x"
                                        f"{image.size[1]} pixels") from exc
    except _PIL_ERRORS as exc:
        raise InputError(field, expected, f"an undecodable image ({type(exc).__name__}: truncated or corrupt)") from exc


def _require(data: bytes, field: str, expected: str) -> None:
    if not data:
        raise InputError(field, expected, "an empty file")


def decode_rgb(data: bytes, max_hw: tuple[int, int]) -> np.ndarray:
    """PNG / JPEG bytes -> writable ``(H, W, 3) uint8`` RGB (alpha dropped, grey and palette expanded).

    A PNG's size and colour type come from its IHDR (no Pillow); a JPEG's header is opened by Pillow for
    its size and mode. The pixels are decoded once, into RGB order (see the module docstring).
    """
    _require(data, "rgb", RGB_EXPECTED)
    kind = sniff(data)
    if kind == "png":
        width, height, bit_depth, colour = _png_header(data, "rgb", RGB_EXPECTED)
        _check_size("rgb", height, width, max_hw)
        if bit_depth == 16:
            raise InputError("rgb", RGB_EXPECTED, f"a 16-bit {_PNG_COLOUR.get(colour, '?')} PNG",
                             "A 16-bit grey PNG is a depth map? Send it as 'depth'")
        if colour not in _PNG_COLOUR:
            raise InputError("rgb", RGB_EXPECTED, f"a PNG of colour type {colour}")
        if FAST_PNG and bit_depth == 8 and colour in (_PNG_COLOUR_RGB, _PNG_COLOUR_RGBA):
            return _drop_alpha(_fast_png(data, "rgb", RGB_EXPECTED), height, width)
    elif kind == "jpeg":
        image = _open(data, "rgb", RGB_EXPECTED, max_hw)  # header only: the size check before any pixel
        if image.mode not in ("RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1"):
            raise InputError("rgb", RGB_EXPECTED, f"an image of mode {image.mode}")
    else:
        raise InputError("rgb", RGB_EXPECTED, "a file that is neither PNG nor JPEG" + (" (.npy)" if kind == "npy" else ""))
    return _cv_decode(data, _CV_RGB, "rgb", RGB_EXPECTED)


def rgb_pixels_reference(data: bytes) -> np.ndarray:
    """The plain twin of :func:`decode_rgb`'s pixel decode (no checks): OpenCV BGR, then ``cvtColor``."""
    bgr = _cv_decode(data, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION, "rgb", RGB_EXPECTED)
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _drop_alpha(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, 3) as is; (H, W, 4) (an RGBA PNG, or RGB with a tRNS colour) without its alpha, as OpenCV's
    ``IMREAD_COLOR`` drops it (no compositing)."""
    if pixels.shape == (height, width, 3) and pixels.dtype == np.uint8:
        return pixels
    if pixels.shape == (height, width, 4) and pixels.dtype == np.uint8:
        return np.ascontiguousarray(pixels[..., :3])
    raise InputError("rgb", RGB_EXPECTED, f"an image decoded as {pixels.dtype} {pixels.shape}")


def _cv_decode(data: bytes, flags: int, field: str, expected: str) -> np.ndarray:
    """Decode the pixels once, with OpenCV (it releases the GIL while it decodes, unlike a Python loop)."""
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    if image is None:
        raise InputError(field, expected, "an undecodable image (truncated or corrupt)")
    return image


def _fast_png(data: bytes, field: str, expected: str) -> np.ndarray:
    """Decode a PNG's pixels with imagecodecs (it releases the GIL), as stored: no conversion."""
    try:
        return _imagecodecs.png_decode(data)
    except (_imagecodecs.PngError, ValueError) as exc:
        raise InputError(field, expected, "an undecodable image (truncated or corrupt)") from exc


def decode_depth(data: bytes, max_hw: tuple[int, int]) -> np.ndarray:
    """16-bit PNG (millimetres) or ``.npy`` (metres) bytes -> float (H, W) metres, 0 / NaN = no reading.

    The result still goes through ``validate.validate_depth`` (in the request's validation), which
    rejects integer ``.npy`` depth and millimetre floats with a hint.
    """
    _require(data, "depth", DEPTH_EXPECTED)
    kind = sniff(data)
    if kind == "npy":
        return _decode_npy(data, max_hw)
    if kind == "jpeg":
        raise InputError("depth", DEPTH_EXPECTED, "a JPEG", "JPEG is lossy and 8-bit: save uint16 millimetres as PNG")
    if kind != "png":
        raise InputError("depth", DEPTH_EXPECTED, "a file that is neither PNG nor .npy")
    width, height, bit_depth, colour = _png_header(data, "depth", DEPTH_EXPECTED)
    _check_size("depth", height, width, max_hw)
    if colour != 0 or bit_depth != 16:
        hint = None
        if bit_depth <= 8:
            hint = "8-bit PNGs cannot hold depth; save uint16 millimetres (16-bit PNG)"
        raise InputError("depth", DEPTH_EXPECTED, f"a {bit_depth}-bit {_PNG_COLOUR.get(colour, '?')} PNG", hint)
    if FAST_PNG:
        millimetres = _fast_png(data, "depth", DEPTH_EXPECTED)
    else:
        millimetres = _cv_decode(data, cv2.IMREAD_UNCHANGED, "depth", DEPTH_EXPECTED)
    if millimetres.shape != (height, width) or millimetres.dtype != np.uint16:
        raise InputError("depth", DEPTH_EXPECTED, f"an image decoded as {millimetres.dtype} {millimetres.shape}")
    return depth_m_from_mm(millimetres)


def mm_in_range(top_mm: int) -> bool:
    """:func:`foundationpose.validate.depth_in_range` of a uint16 millimetre map whose largest reading is
    ``top_mm``, once converted to metres: the conversion never decreases and a uint16 map is finite and non-negative,
    so the metres are in range exactly when the largest converts in range (at most the farthest plausible reading,
    and, unless there is none, at least the nearest farthest one: metres written as millimetres are not)."""
    return depth_in_range(depth_m_from_mm(np.array([top_mm], dtype=np.uint16)))


def depth_m_from_mm(millimetres: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(H, W) uint16 millimetres -> (H, W) float32 metres, in one pass (the cast happens inside the division's
    loop; the same float32 ``mm / 1000`` as :func:`depth_pixels_reference`): a new array, or written into ``out``
    (a float32 array of that shape, e.g. an ingest worker's frame slot) and returned."""
    if out is None:
        out = np.empty(millimetres.shape, np.float32)
    return np.divide(millimetres, _MM_PER_M, out=out, dtype=np.float32)


def depth_pixels_reference(data: bytes) -> np.ndarray:
    """The plain twin of :func:`decode_depth`'s PNG path (no checks): OpenCV, ``astype``, then divide."""
    millimetres = _cv_decode(data, cv2.IMREAD_UNCHANGED, "depth", DEPTH_EXPECTED)
    return millimetres.astype(np.float32) / _MM_PER_M


def _decode_npy(data: bytes, max_hw: tuple[int, int]) -> np.ndarray:
    """``.npy`` bytes -> (H, W) or (H, W, 1) array, a read-only view of ``data`` (nothing else is allocated).

    The header is parsed without unpickling, the dtype checked against the allow-list, the shape against
    ``max_hw`` and the declared data size against the bytes that follow the header: all before any array exists.
    """
    buffer = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buffer)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(buffer)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(buffer)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]}; versions 1.0 and 2.0 are read")
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: every parse failure is the client's input
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise InputError("depth", DEPTH_EXPECTED, f"a corrupt .npy header ({reason})") from exc
    if dtype.hasobject:
        raise InputError("depth", DEPTH_EXPECTED, "an .npy of Python objects")
    if dtype.kind not in _NPY_KINDS or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.itemsize > _NPY_MAX_ITEMSIZE:
        raise InputError("depth", "a float32 .npy in metres (H, W)", f"an .npy of dtype {dtype.str[:40]}")
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise InputError("depth", DEPTH_EXPECTED, f"a corrupt .npy header (shape {shape})")
    if len(shape) == 3 and shape[2] == 1:
        image_shape = shape[:2]
    else:
        image_shape = shape
    if len(image_shape) != 2:
        raise InputError("depth", "float32 metres (H, W)", f"an .npy of shape {shape}")
    _check_size("depth", image_shape[0], image_shape[1], max_hw)
    offset = buffer.tell()
    declared = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    present = len(data) - offset
    if present != declared:
        what = "a truncated" if present < declared else "an oversized"
        raise InputError("depth", DEPTH_EXPECTED,
                         f"{what} .npy (its header declares {declared} bytes of data; {present} follow)")
    array = np.frombuffer(data, dtype=dtype, count=declared // dtype.itemsize, offset=offset)
    return array.reshape(shape, order="F" if fortran_order else "C")


def decode_mask(data: bytes, max_hw: tuple[int, int]) -> np.ndarray:
    """Single-channel PNG bytes -> (H, W) array (bool / uint8 / uint16); > 0 = object."""
    _require(data, "mask", MASK_EXPECTED)
    if sniff(data) != "png":
        raise InputError("mask", MASK_EXPECTED, "a file that is not a PNG")
    width, height, bit_depth, colour = _png_header(data, "mask", MASK_EXPECTED)
    _check_size("mask", height, width, max_hw)
    if colour not in (0, 3):
        raise InputError("mask", MASK_EXPECTED, f"a {bit_depth}-bit {_PNG_COLOUR.get(colour, '?')} PNG",
                         "Save one channel: 0 = background, > 0 = object")
    image = _open(data, "mask", MASK_EXPECTED, max_hw)
    return np.ascontiguousarray(_load(image, "mask", MASK_EXPECTED))


# -- encoders, for clients and tests ---------------------------------------------------------------


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def encode_rgb_png(rgb: np.ndarray) -> bytes:
    """(H, W, 3) uint8 RGB -> PNG bytes."""
    return _png(np.ascontiguousarray(rgb, dtype=np.uint8))


def encode_depth_png_mm(depth_m: np.ndarray) -> bytes:
    """(H, W) float metres -> 16-bit PNG bytes in millimetres (rounded; NaN and < 0 become 0, max 65.535 m)."""
    depth = np.nan_to_num(np.asarray(depth_m, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    millimetres = np.clip(np.round(depth * 1000.0), 0, 65535).astype(np.uint16)
    return _png(millimetres)


def encode_depth_npy(depth_m: np.ndarray) -> bytes:
    """(H, W) float metres -> ``.npy`` bytes (float32)."""
    out = io.BytesIO()
    np.save(out, np.asarray(depth_m, dtype=np.float32), allow_pickle=False)
    return out.getvalue()


def encode_mask_png(mask: np.ndarray) -> bytes:
    """(H, W) bool / integer mask -> 8-bit PNG bytes (255 = object)."""
    return _png((np.asarray(mask) > 0).astype(np.uint8) * 255)
