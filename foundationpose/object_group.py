"""Objects tracked in one step: an :class:`ObjectGroup` (K distinct objects) and the rows of a batch over it.

A track step's rows may belong to different objects (the objects of one frame, several sessions): the step then
runs one render, one refiner forward per iteration and one pose update for all its rows
(:func:`foundationpose.track_graph.track_step`). What differs per object lives in the group's tables, gathered per
row by the batch's row-object indices (device data, so a captured step reads them like its images):

* the meshes (:class:`foundationpose.render.groups.MeshGroup`: a row renders only its own mesh);
* the diameters (:class:`foundationpose.diameters.RowDiameters`: crop windows, xyz normalisation, translation
  scale);
* the validity models and thresholds (:func:`judge_rows`).

A single object is the group of one: its rows all have index 0 and its render is the plain mesh render (no row
indirection). Row i of a group step equals the step of row i's object alone, bit for bit on the CPU (tested).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from foundationpose.diameters import RowDiameters
from foundationpose.mesh import MeshTensors, ObjectModel
from foundationpose.render.groups import MeshGroup, RowMeshes
from foundationpose.validity import ValidityConfig, ValidityModel, judge_validity, measure_validity

__all__ = ["GroupCache", "GroupRows", "ObjectGroup", "group_key", "judge_rows"]


def group_key(objects: Sequence[ObjectModel]) -> frozenset[int]:
    """The cache key of the group of ``objects`` (their identities; the order and repeats do not matter)."""
    return frozenset(id(o) for o in objects)


@dataclass(frozen=True, slots=True, eq=False)
class GroupRows:
    """The rows of one step over a group, in the form the refine functions read an object: ``diameter`` (per row)
    and ``tensors`` (the mesh of a group of one, else a :class:`RowMeshes`)."""

    diameter: RowDiameters
    tensors: MeshTensors | RowMeshes


class ObjectGroup:
    """K distinct objects on one device, in a fixed order (index k = object k); see the module docstring.

    objects: distinct :class:`ObjectModel` s (held: the group keeps them alive). device: where the tables live.
    Raises ValueError for no objects or a repeated one.
    """

    def __init__(self, objects: Sequence[ObjectModel], device: str | torch.device) -> None:
        self.objects = tuple(objects)
        if not self.objects:
            raise ValueError("an object group needs at least one object")
        if len(group_key(self.objects)) != len(self.objects):
            raise ValueError("an object group's objects must be distinct (a repeated object is one index)")
        self.device = torch.device(device)
        self._index = {id(o): k for k, o in enumerate(self.objects)}
        self.diameters = RowDiameters.of([o.diameter for o in self.objects], self.device)
        self.meshes = MeshGroup([o.tensors.to(self.device) for o in self.objects]) if len(self.objects) > 1 else None
        if self.meshes is not None:
            _ = self.meshes.packed  # host-to-device copies now, never inside a capture

    def __len__(self) -> int:
        return len(self.objects)

    @property
    def key(self) -> frozenset[int]:
        return group_key(self.objects)

    def index_of(self, objects: Sequence[ObjectModel]) -> np.ndarray:
        """(n,) int64 row-object indices of ``objects`` (one per row). Raises KeyError for an object not in the
        group."""
        try:
            return np.fromiter((self._index[id(o)] for o in objects), dtype=np.int64, count=len(objects))
        except KeyError:
            raise KeyError("an object of the batch is not in the group") from None

    def rows(self, row_object: Tensor, row_object_host: np.ndarray | None = None) -> GroupRows:
        """The :class:`GroupRows` of a batch whose row i is object ``row_object[i]`` ((N,) int64 on the device; no
        host synchronisation). row_object_host: the same indices on the host when known (the renderers that split
        a group's rows per mesh read them there)."""
        diameters = self.diameters.rows(row_object)
        if self.meshes is None:
            return GroupRows(diameters, self.objects[0].tensors)
        return GroupRows(diameters, RowMeshes(self.meshes, row_object, row_object_host))


def judge_rows(depth_f: Tensor, K: Tensor, start: Tensor, poses: Tensor, row_object: Tensor,
               validity: Sequence[tuple[ValidityModel, ValidityConfig]], **measure_kwargs: object) -> Tensor:
    """The judged rows (B, JUDGED_COLUMNS) float32 of a step over a group: row i is
    :func:`~foundationpose.validity.measure_validity` and :func:`~foundationpose.validity.judge_validity` with
    row i's object's model and thresholds. No host synchronisation.

    validity: one ``(model, config)`` per object of the group, in its order. A group of one is one pass; a larger
    group runs one pass per object over all B rows and keeps each row's own (``torch.where`` on ``row_object``):
    the objects' thresholds are per-object Python floats, which the validity functions take as scalars.
    measure_kwargs: passed to ``measure_validity``.
    """
    judged = None
    for k, (model, config) in enumerate(validity):
        measurements = measure_validity(depth_f, K, start, poses, model, config, **measure_kwargs)
        confidence, valid = judge_validity(measurements, config)
        rows = torch.cat([measurements, confidence[:, None], valid.to(torch.float32)[:, None]], dim=1)
        if judged is None:
            judged = rows
        else:
            judged = torch.where((row_object == k)[:, None], rows, judged)
    assert judged is not None
    return judged


class GroupCache:
    """The object groups a runner has built, keyed by their set of objects, at most ``max_groups`` (the least
    recently used one is dropped beyond it; a step entry keeps its own group alive)."""

    def __init__(self, device: str | torch.device, max_groups: int = 64) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.device = torch.device(device)
        self.max_groups = max_groups
        self._groups: OrderedDict[frozenset[int], ObjectGroup] = OrderedDict()

    def of(self, objects: Sequence[ObjectModel]) -> ObjectGroup:
        """The group of the distinct objects among ``objects``: the cached group of exactly them, else (for two or
        more) the smallest cached group of several objects that holds them all (its steps run any subset of its
        objects, so a batch with a subset of a frame's objects replays the frame's graphs instead of capturing
        new ones), else a new group (ordered by first appearance). Not thread-safe: the runner calls it under its
        lock."""
        key = group_key(objects)
        group = self._groups.get(key)
        if group is None and len(key) > 1:  # a cached group of several objects holding these: its steps serve
            supersets = [g for k, g in self._groups.items() if len(k) > 1 and key <= k]
            group = min(supersets, key=len) if supersets else None
        if group is None:
            distinct = list({id(o): o for o in objects}.values())
            group = self._groups[key] = ObjectGroup(distinct, self.device)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group.key)
        return group

    def forget(self, obj: ObjectModel) -> int:
        """Drop every cached group holding ``obj``; returns how many."""
        keys = [k for k in self._groups if id(obj) in k and any(o is obj for o in self._groups[k].objects)]
        for k in keys:
            del self._groups[k]
        return len(keys)

    def __len__(self) -> int:
        return len(self._groups)
