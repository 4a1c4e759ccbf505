"""Object limits (issue 12, items 1 and 3): faces and register cost at upload (413, or simplify=true),
textures limited on every path, and the object count / memory caps (507)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
import trimesh
from fastapi.testclient import TestClient
from PIL import Image

from foundationpose.synthetic.meshes import make_procedural_mesh, procedural_texture
from server import create_app
from server.errors import ObjectStoreFullError
from server.limits import ObjectLimits, register_cost
from server.objects import ObjectRegistry
from tests.server._helpers import READY_TIMEOUT_S, TINY, assert_error, tiny_config, write_objects_dir

# TINY registers 4 hypotheses x (1 iteration + 1 scoring pass): 8 triangle renders per face
COST_BUDGET_FACES = 300
LIMITS = ObjectLimits(max_faces=500, max_vertices=1000, max_texture_side=64, max_objects=5,
                      max_register_cost=register_cost(COST_BUDGET_FACES, TINY["num_hypotheses"],
                                                      TINY["register_iterations"]))


def _sphere(subdivisions: int) -> trimesh.Trimesh:
    return trimesh.creation.icosphere(subdivisions=subdivisions, radius=0.05)  # 320 faces at 2, 1280 at 3


def _textured_glb(side: int) -> bytes:
    """A GLB whose material embeds a side x side PNG (the issue's case: tiny file, huge texture)."""
    mesh = make_procedural_mesh("textured_asym")
    image = Image.new("RGB", (side, side), (200, 30, 10))
    mesh.visual = trimesh.visual.TextureVisuals(uv=np.asarray(mesh.visual.uv), image=image)
    return mesh.export(file_type="glb")


def _png(image: np.ndarray | Image.Image) -> bytes:
    out = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def limited(tiny_estimator, tmp_path_factory) -> Iterator[TestClient]:
    objects = write_objects_dir(tmp_path_factory.mktemp("objects"))  # 2 objects at start
    config = tiny_config(objects, warmup=False, max_mesh_faces=LIMITS.max_faces, max_mesh_vertices=LIMITS.max_vertices,
                         max_texture_side=LIMITS.max_texture_side, max_objects=LIMITS.max_objects,
                         max_register_cost=LIMITS.max_register_cost)
    assert config.object_limits == LIMITS
    app = create_app(config, estimator=tiny_estimator)
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        yield client


def _upload(client, object_id, data, filename="m.ply", **extra):
    files = {"mesh": (filename, data)}
    if "texture" in extra:
        files["texture"] = ("t.png", extra.pop("texture"))
    return client.post("/objects", data={"object_id": object_id, **extra}, files=files)


def test_a_mesh_above_the_face_limit_is_refused_naming_mesh_and_limit(limited):
    response = _upload(limited, "heavy", _sphere(3).export(file_type="ply"), "heavy.ply")
    body = assert_error(response, 413, "InputTooLargeError", "mesh",
                        r"^mesh: expected a mesh of at most 500 faces and 1000 vertices \(max_mesh_faces")
    assert "; got 'heavy.ply' of object 'heavy' with 1280 faces and 642 vertices. Simplify it" in body["message"]
    assert "simplify=true" in body["message"]
    assert not (limited.app.state.fp.objects.root / "heavy").exists()
    assert limited.get("/objects/heavy").status_code == 404


def test_a_mesh_over_the_register_cost_budget_is_refused_with_the_estimate(limited):
    # 320 faces: within the face limit, but 320 x 4 hypotheses x 2 passes is over the 300-face budget
    response = _upload(limited, "costly", _sphere(2).export(file_type="ply"))
    body = assert_error(response, 413, "InputTooLargeError", "mesh",
                        r"^mesh: expected a mesh this server can register within its request timeout: at most 300 faces")
    assert "estimated cost 2.56e+03 > budget 2.4e+03" in body["message"]


def test_simplify_true_decimates_to_the_budget_and_stores_what_it_registered(limited):
    response = _upload(limited, "simple", _sphere(3).export(file_type="ply"), simplify="true")
    assert response.status_code == 201, response.text
    info = response.json()
    assert info["simplified_from_faces"] == 1280 and 0 < info["faces"] <= COST_BUDGET_FACES
    assert info["mesh_file"] == "simple/mesh.ply"
    stored = trimesh.load(limited.app.state.fp.objects.root / "simple" / "mesh.ply")
    assert len(stored.faces) == info["faces"]
    assert limited.delete("/objects/simple").status_code == 200


def test_embedded_glb_texture_is_downscaled_to_the_limit(limited):
    response = _upload(limited, "bigtex", _textured_glb(512), "t.glb")
    assert response.status_code == 201, response.text
    model = limited.app.state.fp.objects.get("bigtex").model
    assert tuple(model.tensors.texture.shape) == (64, 64, 3)  # 512 -> max_texture_side 64
    np.testing.assert_allclose(model.tensors.texture[32, 32].numpy(), np.array([200, 30, 10]) / 255, atol=1e-6)
    assert limited.delete("/objects/bigtex").status_code == 200


def test_texture_field_is_downscaled_too(limited):
    obj, _ = trimesh.exchange.obj.export_obj(make_procedural_mesh("textured_asym"), include_texture=True,
                                             return_texture=True)
    texture = np.asarray(Image.fromarray(procedural_texture()).resize((256, 128)))
    response = _upload(limited, "fieldtex", obj.encode(), "m.obj", texture=_png(texture))
    assert response.status_code == 201, response.text
    assert tuple(limited.app.state.fp.objects.get("fieldtex").model.tensors.texture.shape) == (32, 64, 3)
    assert limited.delete("/objects/fieldtex").status_code == 200


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow warns on open, we refuse
def test_a_texture_above_pillows_bomb_limit_is_413(limited, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 100)
    assert_error(_upload(limited, "bomb", _textured_glb(128), "b.glb"), 413, "InputTooLargeError", "mesh",
                 r"^mesh: expected a texture image of at most 10000 pixels \(Pillow's decompression-bomb limit\); got 128x128")


def test_the_object_count_cap_answers_507_until_objects_are_deleted(limited):
    small = make_procedural_mesh("plain_asym").export(file_type="ply")
    state = limited.app.state.fp
    added = []
    while len(state.objects) < LIMITS.max_objects:
        added.append(f"fill{len(added)}")
        assert _upload(limited, added[-1], small).status_code == 201
    assert_error(_upload(limited, "onemore", small), 507, "ObjectStoreFullError", None,
                 r"^the server holds 5 objects, its limit \(max_objects = 5\); DELETE /objects/<id> some first")
    assert limited.delete(f"/objects/{added[0]}").status_code == 200
    assert _upload(limited, "onemore", small).status_code == 201
    for object_id in [*added[1:], "onemore"]:
        assert limited.delete(f"/objects/{object_id}").status_code == 200


def test_the_memory_cap_refuses_an_object_that_does_not_fit(tmp_path):
    registry = ObjectRegistry(tmp_path, limits=ObjectLimits(max_total_bytes=1024 * 1024, max_texture_side=4096))
    registry.load_all()
    small = registry.store_upload("small", make_procedural_mesh("plain_asym").export(file_type="ply"), "s.ply", None)
    registry.add(small)
    assert 0 < small.nbytes < 20_000
    registry.reserve("big")
    # 256 x 256 RGB: 0.75 MiB as a float32 tensor + 2 x 0.19 MiB of images (mesh and centred copy)
    with pytest.raises(ObjectStoreFullError, match=r"^object 'big' needs 1\.1 MiB but the loaded objects hold "
                                                   r"0\.0 of 1 MiB \(max_objects_mb\)"):
        registry.store_upload("big", _textured_glb(256), "b.glb", None)
    assert not (tmp_path / "big").exists()
