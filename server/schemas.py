"""Response bodies of the HTTP API (pydantic models; they make the OpenAPI schema and its examples)."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = [
    "POSE_ERRORS",
    "READ_ERRORS",
    "UPLOAD_ERRORS",
    "DeletedObject",
    "DeletedSession",
    "ErrorBody",
    "ErrorDetail",
    "HealthBody",
    "ObjectInfo",
    "ObjectList",
    "ReadyBody",
    "RegisterResponse",
    "SessionInfo",
    "SessionTrack",
    "SessionsTrackResponse",
    "TrackResponse",
]

_POSE_EXAMPLE = [
    [0.9962, -0.0872, 0.0, 0.0123],
    [0.0872, 0.9962, 0.0, -0.0345],
    [0.0, 0.0, 1.0, 0.5012],
    [0.0, 0.0, 0.0, 1.0],
]
_K_EXAMPLE = [[607.06, 0.0, 324.5], [0.0, 606.75, 237.92], [0.0, 0.0, 1.0]]
_POSE_DOC = ("4x4 rigid transform cam_from_mesh (row-major nested lists): maps points of the mesh file's own "
             "frame to the OpenCV camera frame (x right, y down, z forward), translation in metres. For a symmetric "
             "object, the member of the pose's symmetry class nearest the session's previous answer.")
_STATES = "tracking | uncertain | lost | recovering"
_MEASUREMENTS_EXAMPLE = {"in_image_fraction": 1.0, "reading_fraction": 0.98, "agree_fraction": 0.86,
                         "occluded_fraction": 0.02, "behind_fraction": 0.01, "consistent_fraction": 0.95,
                         "support_fraction": 0.84, "residual_m": 0.0021, "translation_m": 0.004, "rotation_deg": 1.2,
                         "visible_points": 231.0, "appearance_cells": 142.0, "texture_contrast": 0.12,
                         "appearance_ncc": 0.93}
_SYMMETRY_EXAMPLE = {"symmetric_under": [], "source": None, "found": [
    {"declaration": "z:inf", "geometry_breaks": False, "texture_breaks": True, "real": False}]}
_SYMMETRY_DOC = ("What the pose is defined up to: the object's symmetries in use and those found in its geometry "
                 "at upload, with whether its texture breaks them (docs/api.md). A symmetric object without a print "
                 "is answered as one member of its symmetry class: the rotations in `symmetric_under` are not known.")


class FoundSymmetryBrief(BaseModel):
    """One symmetry or near-symmetry found in an uploaded mesh's geometry, as a pose answer states it."""

    declaration: str = Field(description="AXIS:ORDER or AXIS:inf in the mesh frame (the upload's `symmetry` "
                                         "spelling), e.g. `z:inf`.")
    geometry_breaks: bool = Field(description="A near-symmetry only: a detail of the shape breaks it (a handle).")
    texture_breaks: bool = Field(description="The shape has it, but the texture does not (a printed label).")
    real: bool = Field(description="Neither breaks it: poses it relates cannot be told apart.")


class PoseSymmetry(BaseModel):
    symmetric_under: list[str] = Field(description="The symmetries the pose is defined up to (declared at upload, "
                                                   "else the real ones found); empty: the orientation is determined.")
    source: str | None = Field(description="`declared`, `found` (at upload), or null: no symmetry in use.")
    found: list[FoundSymmetryBrief] | None = Field(description="What the upload's geometry showed; null: the object "
                                                               "was not searched (put in the objects directory).")


class _Trust(BaseModel):
    """What every pose answer says about its pose."""

    valid: bool = Field(description="The pose is reported valid: the frame passed the validity checks and the "
                                    "session is `tracking` (stateless: the frame's own verdict). A lost or "
                                    "recovering session never answers true.")
    confidence: float | None = Field(description="Confidence in [0, 1] from the validity measurements (null when "
                                                 "none were measured).")
    state: str | None = Field(description=f"The session's state after this frame: {_STATES}; null for a "
                                          "stateless track.")
    source: str = Field(description="Where the pose came from: `register (client mask)`, `track`, or `recovery "
                                    "register (region candidate)` / `recovery register (image candidate)` (a lost "
                                    "session re-registering by itself on a mask found in the depth).")
    measurements: dict[str, float | None] | None = Field(
        description="The validity measurements behind `confidence`, by name (docs/tracking.md).")
    symmetry: PoseSymmetry | None = Field(None, description=_SYMMETRY_DOC)


class ErrorDetail(BaseModel):
    type: str = Field(description="Error class, e.g. InputError, UnknownSessionError, BusyError, InternalError.")
    message: str = Field(description="What was wrong and what is expected.")
    field: str | None = Field(None, description="The request field at fault (rgb, depth, mask, K, pose, object_id, ...).")
    request_id: str = Field(description="Also in the X-Request-ID header; quote it when reporting a 500.")


class ErrorBody(BaseModel):
    error: ErrorDetail

    model_config = {"json_schema_extra": {"examples": [{"error": {
        "type": "InputError", "field": "depth",
        "message": "depth: expected a 16-bit single-channel PNG in millimetres, or a float32 .npy in metres; got "
                   "a 8-bit grey PNG. 8-bit PNGs cannot hold depth; save uint16 millimetres (16-bit PNG)",
        "request_id": "3f9c2a7d1b0e4c55"}}]}}


def _error(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


READ_ERRORS: dict[int | str, dict] = {
    401: _error("Missing or wrong API key (only when the server runs with --api-key)."),
    404: _error("Unknown object_id or session_id (never created, expired or deleted)."),
    422: _error("Bad input (also a malformed multipart body: `field` = `body`); `field` names the culprit and "
                "`message` what is expected."),
    503: _error("Not ready yet (NotReadyError), or shutting down."),
}
_BODY_ERRORS: dict[int | str, dict] = {
    413: _error("Body above --max-upload-mb, an image above --max-image, or a mesh above the mesh limits."),
    415: _error("A body of another Content-Type than the route takes (multipart/form-data; application/octet-stream "
                "for the /binary routes)."),
}
POSE_ERRORS: dict[int | str, dict] = {
    **READ_ERRORS, **_BODY_ERRORS,
    429: _error("SessionBusyError: the session already has a request running and as many waiting as the server "
                "allows (session_waiting); retry after the Retry-After header."),
    500: _error("PoseDivergedError: the pipeline returned a pose with NaN or inf entries (nothing was stored); or "
                "InternalError (quote the request_id)."),
    503: _error("Not ready yet (NotReadyError), too many requests admitted or the pipeline full (OverloadedError, "
                "BusyError), session cap reached with every session busy (SessionLimitError), or shutting down; "
                "retry after the Retry-After header."),
    504: _error("No pose within the server's request timeout."),
}
UPLOAD_ERRORS: dict[int | str, dict] = {**READ_ERRORS, **_BODY_ERRORS}


class RegisterResponse(_Trust):
    session_id: str = Field(description="Pass to POST /track. Expires after the server's session_ttl_s idle seconds "
                                        "(300 unless its --config file says otherwise).")
    object_id: str
    pose: list[list[float]] = Field(description=_POSE_DOC)
    score: float | None = Field(description="Scorer logit of the chosen hypothesis; comparable only within one register "
                                            "call (null if not finite).")
    timings_ms: dict[str, float] = Field(description="Wall milliseconds of this request: the host phases (receive, "
                                                     "parse, decode, validate, submit, pipeline, resume, ...), the "
                                                     "pipeline's stages (upload, hypotheses, refine_score) and "
                                                     "`total`.")

    model_config = {"json_schema_extra": {"examples": [{
        "session_id": "kq3N0c2mXq5b8tY1Zr7xVw", "object_id": "mustard", "pose": _POSE_EXAMPLE, "valid": True,
        "confidence": 0.93, "state": "tracking", "source": "register (client mask)",
        "measurements": _MEASUREMENTS_EXAMPLE, "symmetry": _SYMMETRY_EXAMPLE, "score": 11.73,
        "timings_ms": {"receive": 0.3, "parse": 0.1, "decode": 3.1, "validate": 0.4, "submit": 0.1, "upload": 0.5,
                       "hypotheses": 1.2, "refine_score": 78.0, "pipeline": 84.0, "resume": 0.1, "total": 88.6}}]}}


class TrackResponse(_Trust):
    session_id: str | None = Field(description="The session advanced; null for a stateless request.")
    object_id: str
    pose: list[list[float]] = Field(description=_POSE_DOC)
    frame: int | None = Field(description="Successful track steps of the session so far; null when stateless.")
    timings_ms: dict[str, float] = Field(description="Wall milliseconds of this request: the host phases (receive, "
                                                     "parse, decode, validate, queue, pipeline, resume, ...), the "
                                                     "track step of the batch it ran in (`step`; `batch` = how many "
                                                     "requests shared it) and `total`.")

    model_config = {"json_schema_extra": {"examples": [{
        "session_id": "kq3N0c2mXq5b8tY1Zr7xVw", "object_id": "mustard", "pose": _POSE_EXAMPLE, "valid": True,
        "confidence": 0.91, "state": "tracking", "source": "track", "measurements": _MEASUREMENTS_EXAMPLE,
        "symmetry": _SYMMETRY_EXAMPLE, "frame": 2,
        "timings_ms": {"receive": 0.1, "parse": 0.05, "decode": 0.9, "validate": 0.2, "queue": 0.01,
                       "batcher_wait": 0.1, "step": 1.9, "pipeline": 2.3, "resume": 0.05, "batch": 1.0,
                       "total": 3.6}}]}}


class EntryError(BaseModel):
    type: str = Field(description="Error class, as in an error answer's `error.type`.")
    message: str = Field(description="What was wrong and what is expected.")
    field: str | None = Field(None, description="The request field at fault.")
    retry_after_ms: float | None = Field(None, description="When a full lane or a busy session refused it: about "
                                                           "when to retry.")


class SessionTrack(BaseModel):
    """One session's part of a several-session track: its track answer (status 200) or its error."""

    session_id: str
    object_id: str
    status: int = Field(description="200, or the HTTP status this session's track alone would have answered.")
    pose: list[list[float]] | None = Field(None, description=_POSE_DOC)
    valid: bool | None = Field(None, description="As in `POST /track`'s answer.")
    confidence: float | None = None
    state: str | None = Field(None, description=f"The session's state after this frame: {_STATES}.")
    source: str | None = None
    measurements: dict[str, float | None] | None = None
    symmetry: PoseSymmetry | None = Field(None, description=_SYMMETRY_DOC)
    frame: int | None = Field(None, description="Successful track steps of the session so far.")
    timings_ms: dict[str, float] | None = Field(None, description="This session's phases and track step.")
    error: EntryError | None = Field(None, description="Why this session was not tracked (its state is unchanged).")


class SessionsTrackResponse(BaseModel):
    sessions: list[SessionTrack] = Field(description="One entry per session id, in the request's order.")
    timings_ms: dict[str, float] = Field(description="Wall milliseconds of the request: receive, parse, `pipeline` "
                                                     "(until every session was answered).")

    model_config = {"json_schema_extra": {"examples": [{"sessions": [
        {"session_id": "kq3N0c2mXq5b8tY1Zr7xVw", "object_id": "mustard", "status": 200, "pose": _POSE_EXAMPLE,
         "valid": True, "confidence": 0.91, "state": "tracking", "source": "track",
         "measurements": _MEASUREMENTS_EXAMPLE, "symmetry": _SYMMETRY_EXAMPLE, "frame": 2, "timings_ms": {"decode": 0.9, "step": 2.1, "batch": 2.0}},
        {"session_id": "Pq0Lm2nXc8bV5tY1Zr7xAa", "object_id": "drill", "status": 429,
         "error": {"type": "SessionBusyError", "message": "session Pq0L... has a request running and one waiting",
                   "retry_after_ms": 3.0}}],
        "timings_ms": {"receive": 0.2, "parse": 0.1, "pipeline": 3.4}}]}}


class SessionInfo(BaseModel):
    session_id: str
    object_id: str
    pose: list[list[float]] = Field(description=_POSE_DOC)
    K: list[list[float]] = Field(description="Intrinsics (pixels) used when a track request sends no K.")
    score: float | None = Field(description="The register score; null when not finite or for a session a "
                                            "stream's start message opened from a given pose.")
    frames: int = Field(description="Successful track steps so far.")
    state: str = Field(description=f"The session's state: {_STATES}.")
    idle_s: float = Field(description="Seconds since the last use (before this request).")
    ttl_s: float = Field(description="Idle seconds after which the session expires.")

    model_config = {"json_schema_extra": {"examples": [{
        "session_id": "kq3N0c2mXq5b8tY1Zr7xVw", "object_id": "mustard", "pose": _POSE_EXAMPLE, "K": _K_EXAMPLE,
        "score": 11.73, "frames": 2, "state": "tracking", "idle_s": 0.8, "ttl_s": 300.0}]}}


class DeletedSession(BaseModel):
    session_id: str
    deleted: bool = True


class ObjectInfo(BaseModel):
    object_id: str
    diameter_m: float = Field(description="Largest distance between two mesh vertices, metres (over at most 10 000 "
                                               "of them for larger meshes).")
    extents_m: list[float] = Field(description="Axis-aligned bounding-box size (x, y, z) of the mesh, metres.")
    mesh_centre_m: list[float] = Field(description="Bounding-box centre in the mesh frame, metres.")
    vertices: int
    faces: int
    textured: bool = Field(description="True when rendered with a texture image (else vertex colours).")
    source: str = Field(description="`directory` (found at start) or `upload` (POST /objects).")
    mesh_file: str = Field(description="Path of the mesh file relative to the objects directory.")
    memory_bytes: int = Field(0, description="Memory the loaded object holds (counted against the server's "
                                             "max_objects_mb).")
    simplified_from_faces: int | None = Field(None, description="Faces before `simplify=true` decimated it.")
    symmetry: dict | None = Field(None, description="The symmetries in use (`declared`: declared at upload or, "
                                                    "when none was, the real ones found), the size of their group "
                                                    "(`transforms`) and where they come from (`source`: `declared` "
                                                    "or `found`); null: not symmetric.")
    symmetries_found: list[dict] | None = Field(
        None, description="Symmetries and near-symmetries found in the mesh's geometry at upload, each with its "
                          "`declaration`, the axis' `point_m` (mesh frame), `geometric_fit`, `colour_mismatch`, "
                          "whether the geometry or the texture breaks it and whether it is `real`; null: not "
                          "searched (an object put in the objects directory).")
    validity: dict[str, float] | None = Field(None, description="The object's own validity thresholds; null: "
                                                                "the calibrated defaults (docs/tracking.md).")

    model_config = {"json_schema_extra": {"examples": [{
        "object_id": "mustard", "diameter_m": 0.194, "extents_m": [0.096, 0.064, 0.191],
        "mesh_centre_m": [0.0, 0.0, 0.095], "vertices": 17234, "faces": 34464, "textured": True,
        "source": "directory", "mesh_file": "mustard/textured_simple.obj"}]}}


class ObjectList(BaseModel):
    objects: list[ObjectInfo]


class DeletedObject(BaseModel):
    object_id: str
    deleted: bool = True
    sessions_ended: int = Field(description="Tracking sessions of this object that were ended.")


class HealthBody(BaseModel):
    status: str = Field(description="`ok`, or `failed` when start-up failed or the pipeline broke.")
    phase: str = Field(description="starting | ready | failed | stopping | stopped")


class ReadyBody(BaseModel):
    ready: bool
    phase: str
    reason: str | None = None
    device: str | None = None
    objects: int = 0
    random_weights: bool | None = Field(None, description="True when running without the official weights "
                                                          "(poses are meaningless).")
    settings: dict[str, int | None] = Field(default_factory=dict, description="Algorithm size in use: "
                                            "hypotheses, register_iterations, track_iterations.")
    note: str | None = Field(None, description="Why these settings, e.g. the small default chosen on a CPU.")
    warmup_ms: float | None = Field(None, description="How long the warm-up took, once done.")
    warmup_paths_ms: dict[str, float] | None = Field(
        None, description="The warm-up's steps (`pipeline`, `objects`, `requests`) and each request path's first "
                          "request (`register_png`, `track_binary`, `stream`, ..., `ingest_*`: the slowest ingest "
                          "worker's), in ms, as each is done.")
    ingest: dict[str, int] | None = Field(None, description="With --ingest-workers: their port (`port`: the server's own unless --ingest-port), the "
                                          "workers started (`workers`), connected to this process (`connected`) and whose frame rings are "
                                          "page-locked for the GPU (`page_locked`: their frames skip the staging copy).")
