"""The API's documentation: field and route descriptions, and an OpenAPI schema that says what the server enforces.

:func:`finish_openapi` corrects what FastAPI cannot derive from the handlers' signatures:

* the API key: every route but ``/healthz`` and the docs may answer 401 (and declares the bearer scheme when the
  server has a key);
* ``POST /track`` takes **either** ``session_id`` **or** the stateless ``pose`` + ``object_id`` + ``K`` (JSON
  Schema ``anyOf`` / ``not``);
* the binary bodies need the message container's framing (described, with its smallest size);
* ``texture`` is an optional file, never null; the multipart routes answer 415 to another Content-Type;
  ``POST /readyz/retry``'s 409 has the error body.

"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from server.api.bodies import BINARY_CONTENT_TYPE
from server.auth import PUBLIC_PATHS

__all__ = [
    "API_DESCRIPTION",
    "BINARY_BODY_OPENAPI",
    "BOX_DOC",
    "DEPTH_DOC",
    "DEPTH_DTYPE_DOC",
    "DEPTH_SHAPE_DOC",
    "K_DOC",
    "MASK_DOC",
    "MASK_SHAPE_DOC",
    "REGISTER_BINARY_DESCRIPTION",
    "REGISTER_DESCRIPTION",
    "RGB_DOC",
    "RGB_SHAPE_DOC",
    "TRACK_BINARY_DESCRIPTION",
    "TRACK_DESCRIPTION",
    "finish_openapi",
]

API_DESCRIPTION = """
6D pose of known objects from RGB-D frames (FoundationPose): register an object in a first frame, then
track it frame to frame.

Conventions: `rgb` is read as **RGB** order; depth PNGs are 16-bit **millimetres**, depth `.npy` files
float32 **metres**; `K` is a 3x3 pinhole matrix in pixels; poses are 4x4 `cam_from_mesh` (mesh file
frame to OpenCV camera frame, metres). Errors read
`{"error": {"type", "field", "message", "request_id"}}`; a 503 carries `Retry-After`.

With an API key these pages stay reachable; to try the routes from here press **Authorize** and paste the key.
"""

RGB_DOC = "Colour image, PNG or JPEG, 8 bits per channel; treated as RGB order."
DEPTH_DOC = ("Depth, same size as rgb: a 16-bit single-channel PNG in **millimetres** (0 = no reading; a map whose "
             "readings all lie within 20 mm is refused as metres saved as millimetres), or a `.npy` float32 array "
             "in **metres** (0 or NaN = no reading). Detected by content.")
MASK_DOC = "Object mask, single-channel PNG the size of rgb; pixels > 0 are the object."
BOX_DOC = ("Instead of a mask: a box `x0,y0,x1,y1` in pixels around the object (x1, y1 exclusive, within the "
           "image); the server takes the depth cluster of the object's size inside it (else the box's nearest "
           "surface) as the mask.")
K_DOC = ("Camera intrinsics of this image, JSON 3x3 in pixels: `[[fx, 0, cx], [0, fy, cy], [0, 0, 1]]`; "
         "fx, fy between 1/100 and 100 times the image's longer side, the principal point inside the image.")
RGB_SHAPE_DOC = "Raw rgb: `H,W,3` of uint8 RGB pixels, row-major (the rgb part is then the bare pixel bytes)."
DEPTH_SHAPE_DOC = "Raw depth: `H,W` (the depth part is then the bare values; needs depth_dtype)."
DEPTH_DTYPE_DOC = "Raw depth: `uint16` (millimetres, 0 = no reading) or `float32` (metres), little-endian."
MASK_SHAPE_DOC = "Raw mask: `H,W` of uint8, > 0 = object (the mask part is then the bare bytes)."

REGISTER_DESCRIPTION = """
First frame of an object: about 252 rotation hypotheses are refined and scored and the best is returned
(fewer with the server's `--hypotheses`). Creates a tracking session. The object is shown by a `mask`, or by a
`box` around it; with a `session_id`, the register re-registers that session (e.g. a lost one) in place.

```bash
curl -s -X POST http://127.0.0.1:8000/register \\
  -H "Authorization: Bearer $FP_API_KEY" \\
  -F object_id=mustard -F rgb=@rgb.png -F depth=@depth.png -F mask=@mask.png \\
  -F 'K=[[607.06,0,324.5],[0,606.75,237.92],[0,0,1]]'
```
"""

TRACK_DESCRIPTION = """
Next frame: refine the previous pose. **Either** a `session_id` (the server keeps the pose), **or**, for
stateless clients, the previous `pose` (4x4 cam_from_mesh, JSON) with `object_id` and `K`; `session_id`
excludes `pose` and `object_id`. With a session, `K` defaults to the session's intrinsics (a `K` sent is
used for this frame only); a frame of another size than the session's register frame must send its `K`.
Concurrent requests of one session are applied one after another, in arrival order; requests of
different sessions are batched together. A failed request leaves the session unchanged.

```bash
curl -s -X POST http://127.0.0.1:8000/track \\
  -F session_id=kq3N0c2mXq5b8tY1Zr7xVw -F rgb=@rgb_001.png -F depth=@depth_001.png
```
"""

TRACK_SESSIONS_DESCRIPTION = """
Several objects in one frame: the frame once, with the `session_ids` of the sessions to track into it (one
session per object, registered one by one with `POST /register`). Each session is tracked as by `POST /track`
(its admission, its order with its other requests, its validity and state); their steps are submitted
together, so they share batches (one track step per object). The answer lists every session in the request's
order: its track answer with `status` 200, or its `error` with the status its own track would have answered
(the other sessions are answered all the same; a failed session is unchanged). An unknown session id refuses
the whole request (404, nothing tracked).

```bash
curl -s -X POST http://127.0.0.1:8000/track/sessions \\
  -F session_ids=kq3N0c2mXq5b8tY1Zr7xVw,Pq0Lm2nXc8bV5tY1Zr7xAa -F rgb=@rgb_001.png -F depth=@depth_001.png
```
"""

FRAMING = ("The message container: a `uint32` little-endian header length N, N bytes of a UTF-8 JSON object (the "
           "header), then the parts' bytes back to back. The header's `parts` lists each part in payload order as "
           "`{name, nbytes}` plus, for raw pixels, `shape` and `dtype` (`rgb`: H,W,3 `uint8`; `depth`: H,W "
           "`uint16` millimetres or `float32` metres; `mask`: H,W `uint8`); a part without `shape` is PNG / JPEG / "
           ".npy bytes. Sent as `Content-Type: application/octet-stream`.")

TRACK_BINARY_DESCRIPTION = f"""
`POST /track` in one binary body instead of a multipart form. {FRAMING} The header holds what the
form fields hold: `session_id`, or `object_id` + `pose` (4x4, nested list or JSON text) + `K` for stateless
tracking; `K` (3x3) optional with a session; `parts` describes `rgb` and `depth`. Same rules, errors (422 naming
the field), auth, admission and per-session bounds as `POST /track`; the answer is the same JSON.

```python
from server.client import track_body
body = track_body(rgb, depth_m, session_id=session_id)   # rgb (H, W, 3) uint8, depth_m (H, W) float metres
httpx.post(url + "/track/binary", content=body, headers={{"Content-Type": "application/octet-stream"}})
```
"""

REGISTER_BINARY_DESCRIPTION = f"""
`POST /register` in one binary body instead of a multipart form: the WebSocket stream's register message.
{FRAMING} The header holds `object_id` and `K` (3x3; `"type": "register"` may be given); `parts` describes
`rgb`, `depth` and `mask`. Same rules, errors (422 naming the field), auth and admission as `POST /register`;
the answer is the same JSON (and a session).

```python
from server.client import register_message   # the stream's register message is this body
body = register_message("mustard", K, rgb, depth_m, mask)   # rgb (H, W, 3) uint8, depth_m metres, mask (H, W)
httpx.post(url + "/register/binary", content=body, headers={{"Content-Type": "application/octet-stream"}})
```
"""

# the binary bodies: bytes whose framing the description states; 4 bytes of header length at the least
BINARY_BODY_OPENAPI = {"requestBody": {"required": True, "description": FRAMING, "content": {BINARY_CONTENT_TYPE: {
    "schema": {"type": "string", "format": "binary", "minLength": 4, "description": FRAMING}}}}}

# (field, field) pairs a /track request must not carry together, and the fields of each complete kind
TRACK_EXCLUSIVE = (("session_id", "pose"), ("session_id", "object_id"))
TRACK_KINDS = (("session_id",), ("pose", "object_id", "K"))

_ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
_MULTIPART_PATHS = ("/register", "/track", "/track/sessions", "/objects")


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _form_schema(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The component schema of ``POST path``'s multipart body."""
    operation = schema["paths"].get(path, {}).get("post")
    if operation is None:
        return None
    body = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    ref = body.get("$ref", "")
    return schema["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else body


def finish_openapi(app: FastAPI, *, api_key: bool) -> None:
    """Apply the corrections of the module docstring to ``app``'s schema (built once, on first request)."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default_openapi()
        components = schema.setdefault("components", {})
        if api_key:
            components.setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer",
                "description": "The server's API key (--api-key / FP_API_KEY). In /docs: Authorize, paste the key."}
        for path, operations in schema.get("paths", {}).items():
            if path in PUBLIC_PATHS:
                continue
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.setdefault("401", _error("Missing or wrong API key (only when the server runs with "
                                                   "--api-key)."))
                if api_key:
                    operation["security"] = [{"bearer": []}]
                if method == "post" and path in _MULTIPART_PATHS:
                    responses.setdefault("415", _error("A body that is not a multipart form."))
        track = _form_schema(schema, "/track")
        if track is not None:
            track["not"] = {"anyOf": [{"required": list(pair)} for pair in TRACK_EXCLUSIVE]}
            track["anyOf"] = [{"required": list(kind)} for kind in TRACK_KINDS]
            track["description"] = ("Either session_id, or (stateless) pose, object_id and K; session_id excludes "
                                    "pose and object_id.")
        register = _form_schema(schema, "/register")
        if register is not None:
            register["required"] = [name for name in register.get("required", []) if name != "mask"]
            register["anyOf"] = [{"required": ["mask"]}, {"required": ["box"]}]
            register["not"] = {"required": ["mask", "box"]}
            register["description"] = "The object shown by a mask or by a box, not both."
        upload = _form_schema(schema, "/objects")
        if upload is not None and "texture" in upload.get("properties", {}):
            texture = upload["properties"]["texture"]
            upload["properties"]["texture"] = {"type": "string", "format": "binary",
                                               "title": texture.get("title", "Texture"),
                                               "description": texture.get("description", "")}
        retry = schema["paths"].get("/readyz/retry", {}).get("post")
        if retry is not None:
            retry["responses"]["409"] = _error("Start-up has not failed: nothing to retry.")
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
