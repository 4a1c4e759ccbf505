"""Symmetries found at upload: an uploaded mesh's symmetries are detected from its geometry, kept with it, shown in
its info and stated by every pose answer; a symmetric object without a print is answered with its symmetry."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import trimesh
from fastapi.testclient import TestClient

from foundationpose.synthetic.meshes import make_procedural_mesh, procedural_texture
from server import create_app
from server.objects import found_symmetries
from tests.server._helpers import READY_TIMEOUT_S, tiny_config, write_objects_dir


def _cylinder_ply() -> bytes:
    """A plain 7 x 12 cm cylinder (one colour, no texture): every turn about z and the half-turns across it."""
    mesh = trimesh.creation.cylinder(radius=0.035, height=0.12, sections=48)
    mesh.visual.vertex_colors = np.tile(np.array([180, 60, 60, 255], np.uint8), (len(mesh.vertices), 1))
    return mesh.export(file_type="ply")


def _textured_obj() -> tuple[bytes, bytes]:
    """The textured L-block as OBJ text and its texture PNG: no symmetry of shape or print."""
    import io

    from PIL import Image

    text, _ = trimesh.exchange.obj.export_obj(make_procedural_mesh("textured_asym"), include_texture=True,
                                               return_texture=True)
    png = io.BytesIO()
    Image.fromarray(procedural_texture()).save(png, format="PNG")
    return text.encode(), png.getvalue()


@pytest.fixture(scope="module")
def server(tiny_estimator, tmp_path_factory) -> Iterator[tuple[TestClient, object]]:
    root = write_objects_dir(tmp_path_factory.mktemp("objects"))
    app = create_app(tiny_config(root, warmup=False), estimator=tiny_estimator)  # the warm-up is test_ready_warm's
    with TestClient(app) as client:
        assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
        yield client, root


def test_a_plain_cylinder_is_answered_with_the_symmetry_found(server, enc) -> None:
    client, root = server
    response = client.post("/objects", data={"object_id": "cyl"}, files={"mesh": ("c.ply", _cylinder_ply())})
    assert response.status_code == 201, response.text
    info = response.json()
    found = {d["declaration"]: d for d in info["symmetries_found"]}
    assert found["z:inf"]["real"] and not found["z:inf"]["texture_breaks"] and not found["z:inf"]["geometry_breaks"]
    assert info["symmetry"]["source"] == "found" and "continuous z every 5 deg" in info["symmetry"]["declared"]
    assert info["symmetry"]["transforms"] > 72  # 72 turns about z and their half-turns across it
    assert client.get("/objects/cyl").json() == info
    stored = json.loads((root / "cyl" / "object.json").read_text(encoding="utf-8"))
    assert "symmetry" not in stored and found_symmetries(stored)[0].declaration == "z:inf"

    reg = client.post("/register", data={"object_id": "cyl", "K": enc.K_json}, files=enc.register_files())
    assert reg.status_code == 200, reg.text
    symmetry = reg.json()["symmetry"]
    assert symmetry["source"] == "found" and "continuous z every 5 deg" in symmetry["symmetric_under"]
    assert {"declaration": "z:inf", "geometry_breaks": False, "texture_breaks": False, "real": True} in symmetry["found"]
    step = client.post("/track", data={"session_id": reg.json()["session_id"]}, files=enc.track_files())
    assert step.status_code == 200, step.text
    assert step.json()["symmetry"] == symmetry


def test_a_textured_asymmetric_upload_claims_no_symmetry(server, enc) -> None:
    client, _ = server
    obj, png = _textured_obj()
    response = client.post("/objects", data={"object_id": "ell"}, files={"mesh": ("l.obj", obj), "texture": ("t.png", png)})
    assert response.status_code == 201, response.text
    info = response.json()
    assert info["textured"] and info["symmetry"] is None
    assert all(not d["real"] for d in info["symmetries_found"])
    reg = client.post("/register", data={"object_id": "ell", "K": enc.K_json}, files=enc.register_files())
    assert reg.status_code == 200, reg.text
    assert reg.json()["symmetry"] == {"symmetric_under": [], "source": None,
                                      "found": [{k: d[k] for k in ("declaration", "geometry_breaks", "texture_breaks",
                                                                   "real")} for d in info["symmetries_found"]]}


def test_a_declaration_wins_and_directory_objects_are_not_searched(server, enc) -> None:
    client, _ = server
    response = client.post("/objects", data={"object_id": "cyl4", "symmetry": "z:4"},
                           files={"mesh": ("c.ply", _cylinder_ply())})
    assert response.status_code == 201, response.text
    info = response.json()
    assert info["symmetry"] == {"declared": ["discrete z 4"], "transforms": 4, "source": "declared"}
    assert any(d["declaration"] == "z:inf" and d["real"] for d in info["symmetries_found"])
    block = client.get("/objects/block").json()
    assert block["symmetry"] is None and block["symmetries_found"] is None
    reg = client.post("/register", data={"object_id": "block", "K": enc.K_json}, files=enc.register_files())
    assert reg.json()["symmetry"] == {"symmetric_under": [], "source": None, "found": None}
