"""The object suite's generator: deterministic files, disjoint splits, real textures, and near-symmetries that are
broken the way each object's facts say (geometry or texture), measured on coloured surface samples."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from foundationpose.errors import InputError
from foundationpose.mesh import load_object
from foundationpose.symmetry_evidence import coloured_surface, symmetry_evidence
from foundationpose.synthetic.objects import (
    SPLITS,
    SUITE,
    main,
    make_suite_mesh,
    select_objects,
    write_objects,
)
from foundationpose.synthetic.primitives import circle, prism, rectangle, tube_arc


def test_the_suite_has_eight_objects_split_in_two_disjoint_halves_that_both_mix_the_ways_of_breaking() -> None:
    names = [o.name for o in SUITE]
    assert len(names) == len(set(names)) == 8
    halves = {split: {o.name for o in SUITE if o.split == split} for split in SPLITS}
    assert halves["tune"].isdisjoint(halves["held_out"]) and halves["tune"] | halves["held_out"] == set(names)
    assert len(halves["tune"]) == len(halves["held_out"]) == 4
    for split in SPLITS:
        ways = {w for o in SUITE if o.split == split for s in o.near_symmetries for w in s.broken_by}
        assert ways == {"geometry", "texture"}, split
    assert [o.name for o in select_objects(split="held_out")] == sorted(halves["held_out"], key=names.index)


def test_unknown_objects_and_splits_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(InputError, match="mug, spray_bottle, cereal_box, can, drill, shoe, jar, book") as info:
        select_objects(["mug", "teapot"])
    assert "teapot" in str(info.value)
    with pytest.raises(InputError, match="tune, held_out, all"):
        select_objects(split="train")
    with pytest.raises(InputError, match="at least one object of split 'held_out'"):
        select_objects(["mug"], split="held_out")


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_colours(tmp_path) -> None:
    first = write_objects(tmp_path / "a", ["can", "shoe"], seed=3)
    again = write_objects(tmp_path / "b", ["can", "shoe"], seed=3)
    other = write_objects(tmp_path / "c", ["can"], seed=4)
    for name in ("can", "shoe"):
        data = (tmp_path / "a" / f"{name}.glb").read_bytes()
        assert data == (tmp_path / "b" / f"{name}.glb").read_bytes()
        assert first["objects"][name]["sha256"] == again["objects"][name]["sha256"] == hashlib.sha256(data).hexdigest()
    assert other["objects"]["can"]["sha256"] != first["objects"]["can"]["sha256"]
    # an object is the same whichever others are written with it
    alone = write_objects(tmp_path / "d", ["shoe"], seed=3)
    assert alone["objects"]["shoe"]["sha256"] == first["objects"]["shoe"]["sha256"]
    catalogue = json.loads((tmp_path / "a" / "objects.json").read_text(encoding="utf-8"))
    assert catalogue["seed"] == 3 and set(catalogue["objects"]) == {"can", "shoe"}
    assert catalogue["objects"]["can"]["near_symmetries"][0]["broken_by"] == ["texture"]


@pytest.mark.parametrize("name", [o.name for o in SUITE])
def test_each_object_is_real_sized_textured_and_loads_with_its_texture(tmp_path, name) -> None:
    mesh = make_suite_mesh(name)
    extents = np.asarray(mesh.extents)
    assert 0.05 <= extents.max() <= 0.30 and extents.min() >= 0.02, extents
    path = tmp_path / f"{name}.glb"
    path.write_bytes(mesh.export(file_type="glb"))
    obj = load_object(path)
    assert obj.tensors.has_texture and obj.tensors.uv is not None
    texture = obj.tensors.texture.numpy()
    assert texture.shape[0] >= 256 and len(np.unique(texture.reshape(-1, 3), axis=0)) >= 2
    np.testing.assert_allclose(np.asarray(obj.mesh.vertices), np.asarray(mesh.vertices), atol=1e-6)
    normals = np.asarray(mesh.face_normals)
    outward = ((np.asarray(mesh.triangles_center) - mesh.centroid) * normals).sum(axis=1) > 0
    assert outward.mean() > 0.6  # triangles face out (the rest: concave parts such as a handle's inside)


@pytest.mark.parametrize("name", [o.name for o in SUITE])
def test_each_near_symmetry_is_near_and_broken_by_what_the_facts_say(name) -> None:
    (obj,) = select_objects([name])
    surface = coloured_surface(make_suite_mesh(name))
    assert symmetry_evidence(surface, np.eye(4)) == symmetry_evidence(surface, np.eye(4))
    assert symmetry_evidence(surface, np.eye(4)).geometric_fit == 1.0
    assert symmetry_evidence(surface, np.eye(4)).colour_mismatch == 0.0
    for near in obj.near_symmetries:
        for angle, tf in zip(near.test_angles_deg(), near.transforms_mesh(), strict=True):
            evidence = symmetry_evidence(surface, tf)
            where = f"{name} {near.declaration} at {angle:g} deg: {evidence}"
            assert evidence.geometric_fit >= 0.45, where  # a near-symmetry: most of the shape maps onto itself
            if "geometry" in near.broken_by:
                assert evidence.geometric_fit <= 0.95, where
            else:
                assert evidence.geometric_fit >= 0.99, where  # the shape alone is symmetric ...
            if "texture" in near.broken_by:
                assert evidence.colour_mismatch >= 0.1, where  # ... and the print is not


def test_the_evidence_tells_an_unbroken_symmetry_from_broken_ones() -> None:
    import trimesh

    from foundationpose.synthetic.objects import NearSymmetry

    plain = prism(circle(0.04, 64), 0.0, 0.1)
    mesh = trimesh.Trimesh(plain.vertices, plain.faces, process=False)
    surface = coloured_surface(mesh)
    for tf in NearSymmetry("z:inf", (0.0, 0.0, 0.05), ("geometry",), "none").transforms_mesh():
        evidence = symmetry_evidence(surface, tf)
        assert evidence.geometric_fit > 0.99 and evidence.colour_mismatch == 0.0
    tilted = NearSymmetry("x:4", (0.0, 0.0, 0.05), ("geometry",), "the caps").transforms_mesh()[0]
    assert symmetry_evidence(surface, tilted).geometric_fit < 0.8
    with pytest.raises(ValueError, match=r"\(4, 4\)"):
        symmetry_evidence(surface, np.eye(3))


def test_primitives_are_closed_outward_and_mapped_into_their_cell() -> None:
    box = prism(rectangle(0.1, 0.04), 0.0, 0.2, smooth=False)
    import trimesh

    mesh = trimesh.Trimesh(box.vertices, box.faces)  # merges the split vertices: a closed box
    assert mesh.is_watertight and mesh.volume == pytest.approx(0.1 * 0.04 * 0.2, rel=1e-9)
    assert box.uv.min() >= 0.0 and box.uv.max() <= 1.0
    arc = tube_arc(0.03, 0.005, -60.0, 60.0)
    assert arc.uv.min() >= 0.0 and arc.uv.max() <= 1.0
    with pytest.raises(ValueError, match="same"):
        prism(circle(0.01, 8), 0.0, 0.1, top=circle(0.01, 9))


def test_the_command_writes_the_files_and_refuses_an_unknown_name(tmp_path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--objects", "book"]) == 0
    assert json.loads(capsys.readouterr().out) == {"book": "book.glb"}
    assert (tmp_path / "book.glb").stat().st_size > 1000
    assert main(["--out", str(tmp_path), "--objects", "kettle"]) == 1
    assert "kettle" in capsys.readouterr().err
