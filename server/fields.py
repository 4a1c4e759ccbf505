"""What each request field must hold, in the words every error message uses (``<field>: expected <this>; ...``).

One table, so a field that is missing or empty (FastAPI's validation) and a field that is wrong (the codecs,
``foundationpose.validate``) are described the same way.
"""

from __future__ import annotations

import re

from foundationpose.errors import InputError

__all__ = ["EXPECTED", "ID_CHARS", "ID_PATTERN", "K_EXPECTED", "MAX_SESSIONS_PER_FRAME", "POSE_EXPECTED",
           "SESSION_IDS_PATTERN", "check_id"]

# Object and session ids. Anchored for the OpenAPI schema (ECMA regex); matched with re.fullmatch here,
# because Python's "$" also matches before a trailing newline ("block\n" must not pass as an id).
_ONE_ID = "[A-Za-z0-9_-]{1,64}"
ID_PATTERN = f"^{_ONE_ID}$"
_ID_RE = re.compile(ID_PATTERN)
MAX_SESSIONS_PER_FRAME = 16  # sessions one POST /track/sessions may carry, comma-separated
SESSION_IDS_PATTERN = f"^{_ONE_ID}(,{_ONE_ID}){{0,{MAX_SESSIONS_PER_FRAME - 1}}}$"
ID_CHARS = "1 to 64 characters from A-Z a-z 0-9 _ -"
K_EXPECTED = "a JSON 3x3 array [[fx, 0, cx], [0, fy, cy], [0, 0, 1]] in pixels"
POSE_EXPECTED = "a JSON 4x4 rigid transform cam_from_mesh in metres"

EXPECTED: dict[str, str] = {
    "rgb": "a PNG or JPEG colour image, 8 bits per channel",
    "depth": "a 16-bit single-channel PNG in millimetres, or a float32 .npy in metres",
    "mask": "a single-channel PNG, > 0 = object",
    "box": "a box x0,y0,x1,y1 in pixels around the object (0 <= x0 < x1 <= W, 0 <= y0 < y1 <= H)",
    "K": K_EXPECTED,
    "pose": POSE_EXPECTED,
    "object_id": ID_CHARS,
    "session_id": ID_CHARS,
    "session_ids": f"1 to {MAX_SESSIONS_PER_FRAME} distinct session ids, comma-separated",
    "mesh": "an OBJ, PLY or GLB mesh file",
    "texture": "a PNG or JPEG texture image",
}


def check_id(value: str | None, field: str) -> str:
    """``value`` itself, or InputError naming ``field`` when it does not full-match :data:`ID_PATTERN`."""
    if value is None or not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        shown = "nothing" if value is None else repr(value[:80]) if isinstance(value, str) else type(value).__name__
        raise InputError(field, ID_CHARS, shown)
    return value
