"""The federated dataset value: client id -> examples, a train and a test split, one feature schema.

Every client holds the same named features (numpy arrays whose first axis is the example), with one
dtype and one per-example shape each, so that one plan's inputs fit every client. Client ids are
strings and iterate in sorted order, so anything drawn per client from a seed is the same from one
run to the next whatever order the files listed them in. A client with no examples in a split is
left out of that split (LEAF's splits write such users; a device with nothing to train on is not a
client).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import numpy as np

from ._errors import DataLayoutError, PartitionError

Examples = Mapping[str, np.ndarray]
#: How the test split came about: files of its own (LEAF's test/ folder, TFF's test file, a test
#: table), clients held out whole, a share of each client's examples, or no test split at all.
TestSplit = Literal["files", "clients", "examples", "none"]

STR = "str"  # the dtype name of a text feature (a numpy object array of Python str)


@dataclass(frozen=True)
class FeatureSpec:
    """One feature: its dtype name (numpy's, or ``"str"`` for text) and its shape per example."""

    dtype: str
    shape: tuple[int, ...]


def _dtype_name(array: np.ndarray) -> str:
    return STR if array.dtype == object or array.dtype.kind in "US" else array.dtype.name


def _as_feature(array: object, client: str, name: str, split: str) -> np.ndarray:
    if isinstance(array, np.ndarray) and array.dtype.kind not in "OUS":
        return array
    try:
        out = np.asarray(array)
    except ValueError as exc:  # numpy refuses ragged nested lists
        raise DataLayoutError(
            f"{split} client {client!r}: feature {name!r} is ragged (examples of different shapes); "
            "pad or cut its examples to one shape"
        ) from exc
    if out.dtype.kind == "S":
        out = np.array([v.decode("utf-8") for v in out.ravel()], dtype=object).reshape(out.shape)
    elif out.dtype.kind == "U":
        out = out.astype(object)
    if out.dtype == object and not all(isinstance(v, str) for v in out.ravel()):
        raise DataLayoutError(
            f"{split} client {client!r}: feature {name!r} is ragged or mixed (examples of different shapes, "
            "or values that are neither numbers nor text); give every example one shape and type"
        )
    return out


def check_clients(
    clients: Mapping[str, Examples], split: str
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, FeatureSpec]]:
    """Sorted, validated clients and their shared schema; empty clients are dropped."""
    out: dict[str, dict[str, np.ndarray]] = {}
    schema: dict[str, FeatureSpec] = {}
    first: str | None = None
    for cid in sorted(clients, key=str):
        raw = clients[cid]
        client = str(cid)
        if not raw:
            raise DataLayoutError(
                f"{split} client {client!r} has no features; every client needs the same named features"
            )
        arrays = {name: _as_feature(value, client, name, split) for name, value in raw.items()}
        if first is not None and set(arrays) != set(schema):
            raise DataLayoutError(
                f"{split} client {client!r} has features {sorted(arrays)} but client {first!r} has {sorted(schema)}; "
                "every client needs the same features"
            )
        lengths = {name: (a.shape[0] if a.ndim else -1) for name, a in arrays.items()}
        if len(set(lengths.values())) != 1 or -1 in lengths.values():
            described = ", ".join(f"{name}: {n if n >= 0 else 'a scalar'}" for name, n in sorted(lengths.items()))
            raise DataLayoutError(
                f"{split} client {client!r} has ragged features ({described} examples); "
                "each feature needs one entry per example"
            )
        if next(iter(lengths.values())) == 0:
            continue
        for name, array in arrays.items():
            spec = FeatureSpec(_dtype_name(array), tuple(int(d) for d in array.shape[1:]))
            if name not in schema:
                schema[name] = spec
            elif schema[name] != spec:
                raise DataLayoutError(
                    f"{split} client {client!r}: feature {name!r} is {spec.dtype}{list(spec.shape)} per example but "
                    f"client {first!r} has {schema[name].dtype}{list(schema[name].shape)}; every client needs one dtype and shape"
                )
        first = first or client
        out[client] = arrays
    return out, schema


@dataclass(frozen=True, eq=False)  # arrays have no single truth value: datasets compare by identity
class FederatedDataset:
    """Client id -> examples for training (``train``) and evaluation (``test``), one schema for all.

    Build one with a loader (``load_leaf``, ``load_tff_h5``, ``load_table``), a partitioner
    (``partition_arrays``) or ``FederatedDataset.from_clients``; the constructor checks the schema.
    """

    train: Mapping[str, Examples]
    test: Mapping[str, Examples] = field(default_factory=dict)
    label: str | None = None
    test_split: TestSplit = "none"
    source: str = ""
    #: For token-id features: the token of each id; ``len(vocabulary)`` is the unknown/padding id.
    vocabulary: tuple[str, ...] = ()
    features: Mapping[str, FeatureSpec] = field(init=False)
    #: A label given as text (``"cat"``, ``"dog"``) becomes class ids: the name of each id, the sorted
    #: names of both splits (as ``datasets``' ``class_encode_column`` numbers them); empty otherwise.
    label_names: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        train, schema = check_clients(self.train, "train")
        if not train:
            raise DataLayoutError(f"{self.source or 'the dataset'} has no client with training examples")
        test, test_schema = check_clients(self.test, "test")
        if test and test_schema != schema:
            raise DataLayoutError(
                f"the test split's features {_describe(test_schema)} differ from the training split's {_describe(schema)}"
            )
        if self.label is not None and self.label not in schema:
            raise DataLayoutError(f"label {self.label!r} is not a feature; the features are {sorted(schema)}")
        if self.label is not None and schema[self.label].dtype == STR:
            names = _encode_label(self.label, train, test)
            schema[self.label] = FeatureSpec("int64", schema[self.label].shape)
            object.__setattr__(self, "label_names", names)
        object.__setattr__(self, "train", MappingProxyType({c: MappingProxyType(e) for c, e in train.items()}))
        object.__setattr__(self, "test", MappingProxyType({c: MappingProxyType(e) for c, e in test.items()}))
        object.__setattr__(self, "features", MappingProxyType(dict(sorted(schema.items()))))
        if not test and self.test_split != "none":
            object.__setattr__(self, "test_split", "none")

    @property
    def client_ids(self) -> tuple[str, ...]:
        """The training clients, sorted: the order devices are matched to clients in."""
        return tuple(self.train)

    @property
    def test_client_ids(self) -> tuple[str, ...]:
        return tuple(self.test)

    def __len__(self) -> int:
        return len(self.train)

    def __iter__(self) -> Iterator[tuple[str, Examples]]:
        return iter(self.train.items())

    def examples(self, client: str, split: Literal["train", "test"] = "train") -> Examples:
        clients = self.train if split == "train" else self.test
        if client not in clients:
            raise KeyError(f"no {split} client {client!r}; the dataset has {len(clients)} {split} clients")
        return clients[client]

    def sizes(self, split: Literal["train", "test"] = "train") -> dict[str, int]:
        """Examples per client, in client order."""
        clients = self.train if split == "train" else self.test
        return {c: _num_examples(e) for c, e in clients.items()}

    def num_examples(self, split: Literal["train", "test"] = "train") -> int:
        return sum(self.sizes(split).values())

    def central_test(self) -> dict[str, np.ndarray]:
        """All test clients' examples in one set (client order), for the model's central accuracy."""
        if not self.test:
            return {
                name: np.zeros((0, *spec.shape), dtype=object if spec.dtype == STR else spec.dtype)
                for name, spec in self.features.items()
            }
        return {name: np.concatenate([e[name] for e in self.test.values()]) for name in self.features}

    def renamed(self, names: Mapping[str, str]) -> FederatedDataset:
        """The same dataset with features renamed (old name -> new name), the label with them: a
        file's ``label`` or ``pixels`` named as the task's plan reads its inputs."""
        unknown = sorted(set(names) - set(self.features))
        if unknown:
            raise DataLayoutError(
                f"rename: {', '.join(map(repr, unknown))} {'is not a feature' if len(unknown) == 1 else 'are not features'}"
                f" of {self.source or 'the dataset'}; its features are {', '.join(self.features)}"
            )
        kept = set(self.features) - set(names)
        new_names = list(names.values())
        taken = sorted({n for n in new_names if n in kept or new_names.count(n) > 1})
        if taken:
            raise DataLayoutError(
                f"rename: {', '.join(map(repr, taken))} would name two features; rename the other one too, "
                "or give each feature a name of its own"
            )

        def rename(clients: Mapping[str, Examples]) -> dict[str, dict[str, np.ndarray]]:
            return {c: {names.get(n, n): a for n, a in e.items()} for c, e in clients.items()}

        out = FederatedDataset(
            rename(self.train),
            rename(self.test),
            label=None if self.label is None else names.get(self.label, self.label),
            test_split=self.test_split,
            source=self.source,
            vocabulary=self.vocabulary,
        )
        object.__setattr__(out, "label_names", self.label_names)  # the label's ids are already encoded
        return out

    def describe(self) -> str:
        """One line: clients, examples, features and where the test split comes from."""
        feats = ", ".join(f"{n} {s.dtype}{list(s.shape)}" for n, s in self.features.items())
        return (
            f"{self.source + ': ' if self.source else ''}{len(self.train)} clients, {self.num_examples('train')} training "
            f"examples; test: {len(self.test)} clients, {self.num_examples('test')} examples ({self.test_split}); "
            f"features {feats}"
            + (f"; label {self.label}" if self.label else "")
            + (f" ({len(self.label_names)} classes named in the files)" if self.label_names else "")
        )


def _encode_label(label: str, *splits: dict[str, dict[str, np.ndarray]]) -> tuple[str, ...]:
    """Text labels replaced, in place, by their ids among the sorted names of every split; the names."""
    names = sorted({str(v) for clients in splits for examples in clients.values() for v in examples[label].ravel()})
    ids = {name: i for i, name in enumerate(names)}
    for clients in splits:
        for examples in clients.values():
            text = examples[label]
            examples[label] = np.fromiter((ids[str(v)] for v in text.ravel()), np.int64, text.size).reshape(text.shape)
    return tuple(names)


def _describe(schema: Mapping[str, FeatureSpec]) -> str:
    return "{" + ", ".join(f"{n}: {s.dtype}{list(s.shape)}" for n, s in sorted(schema.items())) + "}"


def _num_examples(examples: Examples) -> int:
    return int(next(iter(examples.values())).shape[0])


def _client_rng(seed: int, client: str) -> np.random.Generator:
    """A client's own stream: its split does not depend on which other clients exist."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(client.encode("utf-8"))])


def take(examples: Examples, index: np.ndarray) -> dict[str, np.ndarray]:
    return {name: array[index] for name, array in examples.items()}


def split_examples(
    clients: Mapping[str, Examples], fraction: float, seed: int
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    """Each client's examples cut into train and test, as LEAF's ``--by_sample`` split does: at least
    one training example per client, ``floor((1 - fraction) * n)`` of them otherwise."""
    if not 0.0 < fraction < 1.0:
        raise PartitionError(f"test_fraction must be between 0 and 1 (exclusive), got {fraction}")
    train: dict[str, dict[str, np.ndarray]] = {}
    test: dict[str, dict[str, np.ndarray]] = {}
    for cid in sorted(clients):
        examples = clients[cid]
        n = _num_examples(examples)
        order = _client_rng(seed, cid).permutation(n)
        n_train = max(1, math.floor((1.0 - fraction) * n + 1e-9))
        train[cid] = take(examples, np.sort(order[:n_train]))
        if n_train < n:
            test[cid] = take(examples, np.sort(order[n_train:]))
    return train, test


def split_clients(
    clients: Mapping[str, Examples], fraction: float, seed: int
) -> tuple[dict[str, Examples], dict[str, Examples]]:
    """Whole clients held out for testing (LEAF's ``--by_user``): ``round(fraction * k)`` of them,
    at least one and never all."""
    if not 0.0 < fraction < 1.0:
        raise PartitionError(f"test_fraction must be between 0 and 1 (exclusive), got {fraction}")
    ids = sorted(clients)
    if len(ids) < 2:
        raise PartitionError(f"holding out clients needs at least 2 clients, got {len(ids)}; use test_split=examples")
    n_test = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    order = np.random.default_rng(int(seed) & 0xFFFFFFFF).permutation(len(ids))
    held = {ids[i] for i in order[:n_test]}
    return {c: clients[c] for c in ids if c not in held}, {c: clients[c] for c in ids if c in held}


def with_test_split(
    train: Mapping[str, Examples],
    *,
    how: Literal["examples", "clients"],
    fraction: float,
    seed: int,
    label: str | None,
    source: str,
    vocabulary: tuple[str, ...] = (),
    test: Mapping[str, Examples] | None = None,
) -> FederatedDataset:
    """A dataset whose test split is cut from ``train``, or is ``test``, the files' own test clients,
    when they bring some (a loader's one way to its dataset)."""
    if test is not None:
        return FederatedDataset(train, test, label=label, test_split="files", source=source, vocabulary=vocabulary)
    train, _ = check_clients(train, "train")
    if how == "examples":
        tr, te = split_examples(train, fraction, seed)
        return FederatedDataset(tr, te, label=label, test_split="examples", source=source, vocabulary=vocabulary)
    if how == "clients":
        tr2, te2 = split_clients(train, fraction, seed)
        return FederatedDataset(tr2, te2, label=label, test_split="clients", source=source, vocabulary=vocabulary)
    raise PartitionError(f"test_split must be 'examples' or 'clients', got {how!r}")
