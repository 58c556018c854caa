"""Row codec: one example <-> one fixed-size payload of little-endian tensor bytes.

Every example of a collection has the same tensor names, dtypes and shapes (its :class:`Schema`),
so a payload is the tensors' raw bytes concatenated in schema order and a chunk of rows decodes
in one ``np.frombuffer`` with a structured dtype: that is what makes streaming reads cheap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .errors import ExampleStoreError, InvalidArgumentError, SchemaMismatchError

#: One example as a store gives it back: named tensors.
Example = dict[str, np.ndarray]
#: One example as an app adds it: named tensors, each an array or anything ``np.asarray`` makes a
#: numeric one of (a numpy scalar such as ``np.int64(label)``, a Python number, a nested list).
#: Typed ``Example``, ``add`` refused a label given as ``np.int64(3)`` under a type checker, as the
#: tutorials give it.
ExampleLike = Mapping[str, ArrayLike]

_NUMERIC_KINDS = frozenset("biufc")  # bool, int, uint, float, complex
_FORMAT_VERSION = 1


def canonical_dtype(dtype: np.dtype) -> np.dtype:
    """The little-endian form of a numeric dtype: payloads are byte-order independent."""
    return dtype.newbyteorder("<") if dtype.byteorder not in ("|", "<") else dtype


def _describe(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{dtype.name}{list(shape)}"


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a collection's schema."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64)))


class Schema:
    """The fixed tensor layout of a collection, recorded on its first insert."""

    def __init__(self, tensors: Sequence[TensorSpec]) -> None:
        if not tensors:
            raise InvalidArgumentError("an example needs at least one tensor")
        self.tensors = tuple(tensors)
        self.names = tuple(t.name for t in self.tensors)
        self.struct = np.dtype([(t.name, t.dtype, t.shape) for t in self.tensors])  # packed, no padding
        self.record_size = self.struct.itemsize
        if self.record_size == 0:
            raise InvalidArgumentError("an example must hold at least one byte of tensor data (all tensors are empty)")
        self._scalar_index: list[tuple[int, Any]] = []

    # -- construction / persistence ---------------------------------------------------------

    @classmethod
    def from_example(cls, example: Any) -> Schema:
        """Infers the schema from the first example added to a collection."""
        example = _check_mapping(example)
        tensors = []
        for name, value in example.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"tensor names must be non-empty strings, got {name!r}")
            arr = np.asarray(value)
            if arr.dtype.kind not in _NUMERIC_KINDS:
                raise InvalidArgumentError(
                    f"tensor {name!r} has dtype {arr.dtype}; only bool, integer, float and complex tensors "
                    f"can be stored: encode text or objects as numeric ids first"
                )
            tensors.append(TensorSpec(name, canonical_dtype(arr.dtype), tuple(int(d) for d in arr.shape)))
        return cls(tensors)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": _FORMAT_VERSION,
                "tensors": [{"name": t.name, "dtype": t.dtype.str, "shape": list(t.shape)} for t in self.tensors],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Schema:
        try:
            doc = json.loads(text)
            version = doc.get("version")
            if type(version) is int and version > _FORMAT_VERSION:  # nothing here is damaged: keep the file
                raise ExampleStoreError(
                    f"a collection's recorded schema is of version {version}, written by a newer version of the "
                    f"example store than this one (which reads version {_FORMAT_VERSION}); open the database with "
                    "that version, the file is left as it is"
                )
            if version != _FORMAT_VERSION:
                raise ValueError(f"unsupported schema version {doc.get('version')!r}")
            return cls([TensorSpec(t["name"], np.dtype(t["dtype"]), tuple(t["shape"])) for t in doc["tensors"]])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ExampleStoreError(
                f"a collection's recorded schema is unreadable ({exc}); the database was written by an "
                f"incompatible version or is damaged: delete the file to start a fresh store"
            ) from exc

    def describe(self) -> str:
        return ", ".join(f"{t.name}: {_describe(t.dtype, t.shape)}" for t in self.tensors)

    def as_dict(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return {t.name: (t.dtype, t.shape) for t in self.tensors}

    # -- encoding ------------------------------------------------------------------------

    def encode(self, examples: Sequence[Any], collection_uri: str) -> bytes:
        """Validates a chunk of examples against the schema and returns their payloads back to back.

        Works column by column (one ``np.array`` per tensor name) rather than example by example,
        which is what keeps inserts close to raw sqlite3 speed."""
        n = len(examples)
        count = len(self.tensors)
        for ex in examples:
            if type(ex) is not dict:
                _check_mapping(ex)
            if len(ex) != count:
                self._mismatch(collection_uri, f"an example has tensors {sorted(map(str, ex))}")
        rec = np.empty(n, dtype=self.struct)
        for spec in self.tensors:
            name = spec.name
            try:
                col = [ex[name] for ex in examples]
            except KeyError:
                bad = next(ex for ex in examples if name not in ex)
                self._mismatch(collection_uri, f"an example has tensors {sorted(map(str, bad))}")
            found = {getattr(v, "dtype", None) for v in col}
            if None in found:  # Python scalars or lists
                col = [np.asarray(v) for v in col]
                found = {v.dtype for v in col}
            dtypes: set[np.dtype] = {dt for dt in found if dt is not None}
            for dt in dtypes:
                if canonical_dtype(dt) != spec.dtype:
                    self._mismatch(collection_uri, f"tensor {name!r} has dtype {np.dtype(dt).name}")
            try:
                stacked = np.array(col, dtype=spec.dtype)
            except ValueError:
                bad = next(np.shape(v) for v in col if np.shape(v) != spec.shape)
                self._mismatch(collection_uri, f"tensor {name!r} has shape {list(bad)}")
            if stacked.shape[1:] != spec.shape:
                self._mismatch(collection_uri, f"tensor {name!r} has shape {list(stacked.shape[1:])}")
            rec[name] = stacked
        return rec.tobytes()

    def encode_columns(self, columns: Mapping[str, np.ndarray], n: int, collection_uri: str) -> bytes:
        """What ``encode`` gives for ``n`` examples held as columns (tensor name -> array whose
        first axis runs over the examples), checked against the schema a column at a time."""
        if set(columns) != set(self.names):
            self._mismatch(collection_uri, f"the examples have tensors {sorted(map(str, columns))}")
        rec = np.empty(n, dtype=self.struct)
        for spec in self.tensors:
            col = np.asarray(columns[spec.name])
            if canonical_dtype(col.dtype) != spec.dtype:
                self._mismatch(collection_uri, f"tensor {spec.name!r} has dtype {col.dtype.name}")
            if col.shape != (n, *spec.shape):
                self._mismatch(collection_uri, f"tensor {spec.name!r} has shape {list(col.shape[1:])}")
            rec[spec.name] = col
        return rec.tobytes()

    def _mismatch(self, collection_uri: str, what: str) -> None:
        raise SchemaMismatchError(
            f"examples of collection {collection_uri!r} must have the schema it was created with "
            f"({self.describe()}), but {what}. Convert the tensors to that schema (e.g. with "
            f"np.asarray(x, dtype=...)) or add these examples to a new collection."
        )

    # -- decoding ------------------------------------------------------------------------

    def decode(self, payload: bytes, n: int) -> dict[str, np.ndarray]:
        """Decodes ``n`` concatenated payloads into one contiguous, writable array per tensor."""
        if len(payload) != n * self.record_size:
            raise ExampleStoreError(
                f"stored examples have {len(payload)} bytes for {n} rows of {self.record_size} bytes: the "
                f"database is damaged; delete the collection's file to start afresh"
            )
        rec = np.frombuffer(payload, dtype=self.struct, count=n)
        return {name: rec[name].copy() for name in self.names}

    def split(self, columns: dict[str, np.ndarray], n: int) -> list[Example]:
        """Per-example dicts whose tensors are views into the decoded columns (no copies)."""
        per_tensor = []
        for spec in self.tensors:
            col = columns[spec.name]
            if spec.shape:
                per_tensor.append(list(col))  # C-level: one view per row
            else:  # 0-d tensors: index with (i, ...) to get 0-d array views, not numpy scalars
                if len(self._scalar_index) < n:
                    self._scalar_index = [(i, Ellipsis) for i in range(n)]
                per_tensor.append(list(map(col.__getitem__, self._scalar_index[:n])))
        names = self.names
        return [dict(zip(names, values)) for values in zip(*per_tensor)]


def _check_mapping(example: Any) -> Mapping:
    if not isinstance(example, Mapping):
        raise InvalidArgumentError(
            f"an example must be a dict of tensor name -> numpy array, got {type(example).__name__}"
        )
    if not example:
        raise InvalidArgumentError("an example must hold at least one tensor, got an empty dict")
    return example
