"""Objects tracked in one step: an :class:`ObjectGroup` (K distinct objects) and the rows of a batch over it.

A track step's rows may belong to different objects (the objects of one frame, several sessions): the step then
runs one render, one refiner forward per iteration and one pose update for all its rows
(:func:`foundationpose.track_graph.track_step`). What differs per object lives in the group's tables, gathered per
row by the batch's row-object indices (device data, so a captured step reads them like its images):

* the meshes (:class:`foundationpose.render.groups.MeshGroup`: a row renders only its own mesh);
* the diameters (:class:`foundationpose.diameters.RowDiameters`: crop windows, xyz normalisation, translation
  scale);
* the validity models and thresholds (:meth:`ObjectGroup.validity`: a :class:`~foundationpose.validity.
  ValidityTable`, so :func:`judge_rows` measures and judges every row of a step in ONE pass, whatever its objects).

A single object is the group of one: its rows all have index 0 and its render is the plain mesh render (no row
indirection). Row i of a group step equals the step of row i's object alone, bit for bit on the CPU (tested).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from foundationpose.diameters import RowDiameters
from foundationpose.mesh import MeshTensors, ObjectModel
from foundationpose.render.groups import MeshGroup, RowMeshes
from foundationpose.validity import (
    ValidityConfig,
    ValidityModel,
    ValidityRows,
    ValidityTable,
    judge_validity,
    measure_validity_rows,
)

__all__ = ["MAX_GROUP_OBJECTS", "GroupCache", "GroupRows", "ObjectGroup", "group_key", "judge_rows"]

# The most objects one group holds. A group's packed mesh tables copy its meshes (textures included) once more on
# the device, and every group holding an object keeps such a copy; a batch brings at most its rows' objects (16 by
# default), so only a prepared group of every loaded object (the server's warm-up) can reach it.
MAX_GROUP_OBJECTS = 32


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
    Raises ValueError for no objects, a repeated one or more than :data:`MAX_GROUP_OBJECTS`.
    """

    def __init__(self, objects: Sequence[ObjectModel], device: str | torch.device) -> None:
        self.objects = tuple(objects)
        if not self.objects:
            raise ValueError("an object group needs at least one object")
        if len(group_key(self.objects)) != len(self.objects):
            raise ValueError("an object group's objects must be distinct (a repeated object is one index)")
        if len(self.objects) > MAX_GROUP_OBJECTS:
            raise ValueError(f"an object group holds at most {MAX_GROUP_OBJECTS} objects; got {len(self.objects)}")
        self.device = torch.device(device)
        self._index = {id(o): k for k, o in enumerate(self.objects)}
        self.diameters = RowDiameters.of([o.diameter for o in self.objects], self.device)
        self.meshes = MeshGroup([o.tensors.to(self.device) for o in self.objects]) if len(self.objects) > 1 else None
        if self.meshes is not None:
            _ = self.meshes.packed  # host-to-device copies now, never inside a capture
        self._validity: ValidityTable | None = None

    def validity(self, models: Callable[[ObjectModel], ValidityModel],
                 configs: Callable[[ObjectModel], ValidityConfig]) -> ValidityTable:
        """The group's :class:`~foundationpose.validity.ValidityTable` (object k's model ``models(o)`` and thresholds
        ``configs(o)`` at index k), built on the first call and kept (host-to-device copies: call it outside a
        capture; the runner does before it builds a step)."""
        if self._validity is None:
            self._validity = ValidityTable.of([(models(o), configs(o)) for o in self.objects], self.device)
        return self._validity

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


def judge_rows(depth_f: Tensor, K: Tensor, start: Tensor, poses: Tensor, rows: ValidityRows,
               appearance: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The judged rows (B, JUDGED_COLUMNS) float32 of a step over a group: row i is
    :func:`~foundationpose.validity.measure_validity_rows` and :func:`~foundationpose.validity.judge_validity` with
    row i's object's points and thresholds (``rows``: :meth:`ValidityTable.rows
    <foundationpose.validity.ValidityTable.rows>` of the step's row-object indices). ONE pass over the B rows
    whatever the group's size; no host synchronisation. appearance: passed to ``measure_validity_rows``.
    """
    measurements = measure_validity_rows(depth_f, K, start, poses, rows, appearance)
    confidence, valid = judge_validity(measurements, rows.params)
    return torch.cat([measurements, confidence[:, None], valid.to(torch.float32)[:, None]], dim=1)


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
