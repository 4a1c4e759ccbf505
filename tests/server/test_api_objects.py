"""/objects: load at start, upload, list, delete (with its sessions), and paths that never leave the directory."""

from __future__ import annotations

import io

import numpy as np
import pytest
import trimesh
from PIL import Image

from foundationpose.synthetic.meshes import make_procedural_mesh, procedural_texture
from tests.server._helpers import assert_error, register


def _obj_bytes(kind: str = "textured_asym") -> bytes:
    text, _ = trimesh.exchange.obj.export_obj(make_procedural_mesh(kind), include_texture=True, return_texture=True)
    return text.encode()


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def _objects_dir(client):
    return client.app.state.fp.objects.root


def test_objects_in_the_directory_are_loaded_at_start(client):
    listing = {o["object_id"]: o for o in client.get("/objects").json()["objects"]}
    assert {"block", "block2"} <= set(listing)
    block = listing["block"]
    assert block["source"] == "directory" and block["mesh_file"] == "block.ply"
    assert block["faces"] == 20 and block["vertices"] == 12  # trimesh merges the PLY's duplicate corners
    np.testing.assert_allclose(block["extents_m"], [0.12, 0.08, 0.05], atol=1e-6)
    assert 0.15 < block["diameter_m"] < 0.16  # the L block's longest vertex pair, about 15.3 cm
    assert listing["block2"]["mesh_file"] == "block2/model.obj"
    assert client.get("/objects/block").json() == block


@pytest.mark.slow
def test_upload_textured_obj_then_delete_it_with_its_sessions(client, enc):
    response = client.post("/objects", data={"object_id": "up_tex"},
                           files={"mesh": ("whatever.obj", _obj_bytes()), "texture": ("t.png", _png(procedural_texture()))})
    assert response.status_code == 201, response.text
    info = response.json()
    assert info["textured"] is True and info["source"] == "upload" and info["mesh_file"] == "up_tex/mesh.obj"
    folder = _objects_dir(client) / "up_tex"
    assert sorted(p.name for p in folder.iterdir()) == ["mesh.obj", "object.json", "texture.png"]
    assert not any(p.name.startswith(".staging") for p in _objects_dir(client).iterdir())

    sid = register(client, enc, object_id="up_tex")["session_id"]
    assert_error(client.post("/objects", data={"object_id": "up_tex"}, files={"mesh": ("m.obj", _obj_bytes())}),
                 409, "ConflictError", "object_id", r"^object_id: 'up_tex' already exists")

    deleted = client.delete("/objects/up_tex")
    assert deleted.json() == {"object_id": "up_tex", "deleted": True, "sessions_ended": 1}
    assert not folder.exists()
    assert_error(client.get(f"/sessions/{sid}"), 404, "UnknownSessionError")
    assert_error(client.delete("/objects/up_tex"), 404, "UnknownObjectError", "object_id")
    assert "up_tex" not in {o["object_id"] for o in client.get("/objects").json()["objects"]}


@pytest.mark.parametrize("fmt", ["ply", "glb"])
def test_upload_ply_and_glb_detected_by_content(client, fmt):
    data = make_procedural_mesh("vertex_color_asym").export(file_type=fmt)
    object_id = f"up_{fmt}"
    response = client.post("/objects", data={"object_id": object_id}, files={"mesh": ("no_suffix", data)})
    assert response.status_code == 201, response.text
    assert response.json()["mesh_file"] == f"{object_id}/mesh.{fmt}"
    assert client.delete(f"/objects/{object_id}").status_code == 200


def test_uploaded_objects_are_reloaded_from_disk(client, tmp_path):
    from server.objects import ObjectRegistry

    assert client.post("/objects", data={"object_id": "up_reload"},
                       files={"mesh": ("m.obj", _obj_bytes()), "texture": ("t.png", _png(procedural_texture()))}
                       ).status_code == 201
    fresh = ObjectRegistry(_objects_dir(client))
    assert "up_reload" in fresh.load_all()
    entry = fresh.get("up_reload")
    assert entry.source == "upload" and entry.textured
    assert client.delete("/objects/up_reload").status_code == 200


@pytest.mark.parametrize(
    "object_id",
    ["../escape", "..", ".", "a/b", "a\\b", "x" * 65, "", "spaces here", "dot.name", "%2e%2e", "ümlaut"],
)
def test_bad_object_ids_are_refused_and_nothing_is_written_outside(client, object_id, tmp_path):
    before = sorted(p.name for p in _objects_dir(client).parent.iterdir())
    response = client.post("/objects", data={"object_id": object_id}, files={"mesh": ("m.obj", _obj_bytes())})
    assert_error(response, 422, "InputError", "object_id")
    assert sorted(p.name for p in _objects_dir(client).parent.iterdir()) == before


def test_path_traversal_in_the_url_never_reaches_the_filesystem(client):
    for path in ("/objects/..%2F..%2Fetc", "/objects/%2e%2e", "/objects/a.b"):
        response = client.delete(path)
        assert response.status_code in (404, 422), (path, response.text)
    assert (_objects_dir(client) / "block.ply").is_file()


def test_bad_meshes_and_textures(client):
    assert_error(client.post("/objects", data={"object_id": "bad1"}, files={"mesh": ("m.stl", b"solid x\nendsolid")}),
                 422, "InputError", "mesh", r"^mesh: expected an OBJ, PLY or GLB")
    assert_error(client.post("/objects", data={"object_id": "bad2"}, files={"mesh": ("m.obj", b"# nothing here\n")}),
                 422, "InputError", "mesh")
    assert_error(client.post("/objects", data={"object_id": "bad3"}, files={"mesh": ("m.obj", b"")}),
                 422, "InputError", "mesh", r"^mesh: .*got an empty file")
    plain_ply = make_procedural_mesh("plain_asym").export(file_type="ply")
    assert_error(client.post("/objects", data={"object_id": "bad4"},
                             files={"mesh": ("m.ply", plain_ply), "texture": ("t.png", _png(procedural_texture()))}),
                 422, "InputError", "texture", r"^texture: expected a mesh with one UV coordinate per vertex")
    assert_error(client.post("/objects", data={"object_id": "bad5"},
                             files={"mesh": ("m.obj", _obj_bytes()), "texture": ("t.png", b"GIF89a...")}),
                 422, "InputError", "texture")
    # failed uploads leave no folder and free the id
    names = {p.name for p in _objects_dir(client).iterdir()}
    assert not names & {"bad1", "bad2", "bad3", "bad4", "bad5"} and not any(n.startswith(".") for n in names)
    ok = client.post("/objects", data={"object_id": "bad5"}, files={"mesh": ("m.obj", _obj_bytes())})
    assert ok.status_code == 201
    assert client.delete("/objects/bad5").status_code == 200
