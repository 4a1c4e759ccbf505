"""``/objects``: upload, list, read and delete meshes (stored under the objects directory only)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, File, Form, Path, UploadFile

from foundationpose.errors import InputError
from server.api.bodies import MultipartRoute
from server.api.host import HostDep
from server.errors import ObjectStoreFullError
from server.objects import OBJECT_ID_PATTERN, ObjectEntry, ObjectRegistry, object_properties
from server.schemas import READ_ERRORS, UPLOAD_ERRORS, DeletedObject, ObjectInfo, ObjectList

__all__ = ["UPLOAD_DESCRIPTION", "router", "store_object"]

router = APIRouter(tags=["objects"], route_class=MultipartRoute)  # a form route answers 415 to another body

UPLOAD_DESCRIPTION = f"""
Upload a mesh in **metres** (OBJ, PLY or GLB; format detected from the content, then the file name) and,
optionally, a texture image (PNG/JPEG) mapped on the mesh's own UV coordinates. The object is stored
as `<objects dir>/<object_id>/` and loaded again at the next start. `object_id` must match
`{OBJECT_ID_PATTERN}` (the whole id: no trailing newline); an id that exists already answers 409 (DELETE it first).

Limits (keys of the server's `--config` file): a mesh above `max_mesh_faces` / `max_mesh_vertices`, or too
heavy to register within the request timeout at the server's hypothesis count, answers 413 naming the limit;
`simplify=true` decimates it to the limit instead (quadric edge collapse; its colours and texture are
dropped, and the simplified mesh is what gets stored). Textures larger than `max_texture_side` are
downscaled. When the server holds `max_objects` objects or `max_objects_mb` of object memory, uploads
answer 507: delete objects first.

```bash
curl -s -X POST http://127.0.0.1:8000/objects \\
  -F object_id=mustard -F mesh=@textured_simple.obj -F texture=@texture_map.png
```
"""


@router.post("/objects", status_code=201, response_model=ObjectInfo,
            responses={**UPLOAD_ERRORS, 409: READ_ERRORS[422] | {"description": "object_id already exists."},
                       507: READ_ERRORS[422] | {"description": "The object count or memory limit is reached."}},
            summary="Upload an object mesh", description=UPLOAD_DESCRIPTION)
async def upload_object(
    host: HostDep,
    object_id: Annotated[str, Form(description=f"New object's id, {OBJECT_ID_PATTERN}.", examples=["mustard"],
                                   pattern=OBJECT_ID_PATTERN)],
    mesh: Annotated[UploadFile, File(description="OBJ, PLY or GLB mesh in metres.")],
    texture: Annotated[UploadFile | None, File(description="Optional PNG/JPEG texture for the mesh's UVs.")] = None,
    simplify: Annotated[bool, Form(description="Decimate a mesh above the face limit to it instead of answering "
                                               "413 (drops its colours and texture).")] = False,
    symmetry: Annotated[str | None, Form(description="The object's symmetries in its mesh frame, about axes through "
                                                     "its bounding-box centre, separated by spaces: AXIS:ORDER "
                                                     "(discrete, e.g. `z:4`) or AXIS:inf (continuous); AXIS is x, y, z "
                                                     "or `ax,ay,az`. Registers search the reduced grid; answers show "
                                                     "the member of the pose's class nearest the session's previous "
                                                     "one.", examples=["z:4 x:2"], min_length=1)] = None,
    validity: Annotated[str | None, Form(description="The object's own validity thresholds, a JSON object by name "
                                                     "(docs/tracking.md); the others keep their defaults.",
                                         examples=['{"max_translation_m": 0.05}'], min_length=1)] = None,
) -> ObjectInfo:
    host.require_ready()
    declared = declared_properties(symmetry, validity)
    entry = await store_object(host.objects, object_id, mesh, texture, simplify, declared)
    host.object_stored(entry)
    return ObjectInfo(**entry.info())


def declared_properties(symmetry: str | None, validity: str | None) -> dict[str, Any]:
    """An upload's ``symmetry`` and ``validity`` fields as ``object.json`` holds them (checked when loaded)."""
    declared: dict[str, Any] = {}
    if symmetry is not None:
        declared["symmetry"] = symmetry.split()
    if validity is not None:
        try:
            declared["validity"] = json.loads(validity)
        except ValueError:
            raise InputError("validity", "a JSON object of thresholds by name", ascii(validity)[:80]) from None
    object_properties(declared)  # 422 before the mesh is read
    return declared


async def store_object(registry: ObjectRegistry, object_id: str, mesh: UploadFile, texture: UploadFile | None,
                       simplify: bool, declared: dict[str, Any] | None = None) -> ObjectEntry:
    """Check, store (under the objects directory) and register one upload; the id is reserved meanwhile."""
    registry.reserve(object_id)  # validates the id; 409 when taken, 507 when the registry is full
    try:
        mesh_bytes = await mesh.read()
        texture_bytes = await texture.read() if texture is not None else None
        entry = await anyio.to_thread.run_sync(registry.store_upload, object_id, mesh_bytes, mesh.filename,
                                               texture_bytes, simplify, declared)
    except BaseException:
        registry.release(object_id)
        raise
    try:
        registry.add(entry)  # memory is checked again here, where the dictionary changes
    except ObjectStoreFullError:
        await anyio.to_thread.run_sync(registry.delete_files, entry)
        raise
    return entry


ObjectIdPath = Annotated[str, Path(description="Id of a loaded object.", pattern=OBJECT_ID_PATTERN)]


@router.get("/objects", response_model=ObjectList, responses=READ_ERRORS, summary="List the loaded objects")
async def list_objects(host: HostDep) -> ObjectList:
    host.require_ready()
    return ObjectList(objects=[ObjectInfo(**e.info()) for e in host.objects.entries()])


@router.get("/objects/{object_id}", response_model=ObjectInfo, responses=READ_ERRORS, summary="Describe one object")
async def get_object(host: HostDep, object_id: ObjectIdPath) -> ObjectInfo:
    host.require_ready()
    return ObjectInfo(**host.objects.get(object_id).info())


@router.delete("/objects/{object_id}", response_model=DeletedObject, responses=READ_ERRORS,
               summary="Delete an object, its files and its tracking sessions",
               description="Removes the object from the registry, ends its tracking sessions and deletes `<id>/` "
                           "(or `<id>.obj|.ply|.glb`) from the objects directory, so it does not come back at the "
                           "next start (a symlink is unlinked, never followed). "
                           "`curl -s -X DELETE http://127.0.0.1:8000/objects/mustard`")
async def delete_object(host: HostDep, object_id: ObjectIdPath) -> DeletedObject:
    host.require_ready()
    entry = host.objects.remove(object_id)
    ended = host.sessions.delete_object(object_id)
    host.object_deleted(object_id)
    await anyio.to_thread.run_sync(host.objects.delete_files, entry)
    return DeletedObject(object_id=object_id, sessions_ended=ended)


