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
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import numpy as np

from ._errors import DataLayoutError, PartitionError

Examples = Mapping[str, np.ndarray]
#: How the test split came about: files of its own (LEAF's test/ folder, TFF's test file, a test
#: table), clients held out whole, a share of each client's examples, one central test set of no
#: client's (an npz's x_test, a DatasetDict's test split, beside a partitioner's clients: the one
#: test client ``CENTRAL``), or no test split at all.
TestSplit = Literal["files", "clients", "examples", "central", "none"]
#: The one test client of a central test set.
CENTRAL = "central"

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


def check_client(
    client: str,
    shapes: Mapping[str, tuple[str, tuple[int, ...]]],
    schema: dict[str, FeatureSpec],
    first: str | None,
    split: str,
) -> int:
    """A client's number of examples, once its features (name -> dtype name and whole shape, read
    from its arrays or from a file's declarations) agree with each other and with ``schema`` (the
    first client's, filled in by the first client with examples)."""
    if not shapes:
        raise DataLayoutError(f"{split} client {client!r} has no features; every client needs the same named features")
    if first is not None and shapes.keys() != schema.keys():
        raise DataLayoutError(
            f"{split} client {client!r} has features {sorted(shapes)} but client {first!r} has {sorted(schema)}; "
            "every client needs the same features"
        )
    lengths = {name: (shape[0] if shape else -1) for name, (_, shape) in shapes.items()}
    if len(set(lengths.values())) != 1 or -1 in lengths.values():
        described = ", ".join(f"{name}: {n if n >= 0 else 'a scalar'}" for name, n in sorted(lengths.items()))
        raise DataLayoutError(
            f"{split} client {client!r} has ragged features ({described} examples); "
            "each feature needs one entry per example"
        )
    count = next(iter(lengths.values()))
    if count == 0:
        return 0
    for name, (dtype, shape) in shapes.items():
        known = schema.get(name)
        if known is None:
            schema[name] = FeatureSpec(dtype, tuple(int(d) for d in shape[1:]))
        elif known.dtype != dtype or known.shape != shape[1:]:
            spec = FeatureSpec(dtype, tuple(int(d) for d in shape[1:]))
            raise DataLayoutError(
                f"{split} client {client!r}: feature {name!r} is {spec.dtype}{list(spec.shape)} per example but "
                f"client {first!r} has {known.dtype}{list(known.shape)}; every client needs one dtype and shape"
            )
    return count


def check_clients(
    clients: Mapping[str, Examples], split: str
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, FeatureSpec]]:
    """Sorted, validated clients and their shared schema; empty clients are dropped."""
    out: dict[str, dict[str, np.ndarray]] = {}
    schema: dict[str, FeatureSpec] = {}
    first: str | None = None
    names: dict[np.dtype, str] = {}  # a dtype's name is slow to compute, and clients share a few dtypes
    for cid in sorted(clients, key=str):
        client = str(cid)
        arrays = {name: _as_feature(value, client, name, split) for name, value in clients[cid].items()}
        shapes = {}
        for name, a in arrays.items():
            dtype = names.get(a.dtype)
            if dtype is None:
                dtype = names[a.dtype] = _dtype_name(a)
            shapes[name] = (dtype, a.shape)
        if check_client(client, shapes, schema, first, split):
            first = first or client
            out[client] = arrays
    return out, schema


#: The bytes of examples a lazily read dataset keeps between reads (the clients read last).
CACHE_BYTES = 256 * 2**20


class LazyClients(Mapping[str, Examples]):
    """Client id -> examples, read from a file when first asked for (``read(client)``); the ids,
    sizes and schema are known up front, and the clients read last are kept up to ``budget`` bytes
    (at least the last one), so a file larger than memory serves any number of reads. ``labels``:
    each client's values of the feature ``label``, read up front (the class ids a fleet checks and
    sizes its model by); ``label_names`` as ``FederatedDataset.label_names``, when the reader
    encodes a text label."""

    def __init__(
        self,
        sizes: Mapping[str, int],
        features: Mapping[str, FeatureSpec],
        read: Callable[[str], dict[str, np.ndarray]],
        *,
        label: str | None = None,
        labels: Mapping[str, np.ndarray] | None = None,
        label_names: tuple[str, ...] = (),
        budget: int = CACHE_BYTES,
    ) -> None:
        self.sizes = MappingProxyType({c: n for c, n in sorted(sizes.items()) if n})
        self.features = MappingProxyType(dict(features))
        self.label = label
        self.labels = MappingProxyType(dict(labels or {}))
        self.label_names = label_names
        self._read = read
        self._budget = budget
        self._kept: OrderedDict[str, Examples] = OrderedDict()
        self._held = 0

    def renamed(self, names: Mapping[str, str]) -> LazyClients:
        """The same clients with features renamed (old name -> new name), read as they are asked for."""
        read = self._read

        def renamed(client: str) -> dict[str, np.ndarray]:
            return {names.get(n, n): a for n, a in read(client).items()}

        return LazyClients(
            self.sizes,
            {names.get(n, n): f for n, f in self.features.items()},
            renamed,
            label=None if self.label is None else names.get(self.label, self.label),
            labels=self.labels,
            label_names=self.label_names,
            budget=self._budget,
        )

    def __getitem__(self, client: str) -> Examples:
        kept = self._kept.get(client)
        if kept is not None:
            self._kept.move_to_end(client)
            return kept
        if client not in self.sizes:
            raise KeyError(client)
        examples: Examples = MappingProxyType(self._read(client))
        self._kept[client] = examples
        self._held += _nbytes(examples)
        while self._held > self._budget and len(self._kept) > 1:
            self._held -= _nbytes(self._kept.popitem(last=False)[1])
        return examples

    def __contains__(self, client: object) -> bool:
        return client in self.sizes

    def __iter__(self) -> Iterator[str]:
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def _nbytes(examples: Examples) -> int:
    return sum(int(a.nbytes) for a in examples.values())


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
    #: Why a test split asked for is not there ("" when it is): ``test_split="examples"`` over clients
    #: of one example, which each keep it for training; ``describe()`` and a fleet run say it.
    test_note: str = field(init=False, default="")

    def __post_init__(self) -> None:
        lazy = self.train if isinstance(self.train, LazyClients) else None
        train: Mapping[str, Examples]
        if lazy is not None:  # its reader checks what it reads, and encodes a text label
            train, schema = lazy, dict(lazy.features)
            object.__setattr__(self, "label_names", lazy.label_names)
        else:
            train, schema = check_clients(self.train, "train")
        if not train:
            raise DataLayoutError(f"{self.source or 'the dataset'} has no client with training examples")
        test, test_schema = check_clients(self.test, "test")
        if test:
            check_test_schema(test_schema, schema)
        if self.label is not None and self.label not in schema:
            raise DataLayoutError(f"label {self.label!r} is not a feature; the features are {sorted(schema)}")
        if self.label is not None and schema[self.label].dtype == STR:
            assert isinstance(train, dict)  # a lazy reader encodes its text label as it reads
            names = encode_label(self.label, label_names(self.label, train, test), train, test)
            schema[self.label] = FeatureSpec("int64", schema[self.label].shape)
            object.__setattr__(self, "label_names", names)
        if lazy is None:
            object.__setattr__(self, "train", MappingProxyType({c: MappingProxyType(e) for c, e in train.items()}))
        object.__setattr__(self, "test", MappingProxyType({c: MappingProxyType(e) for c, e in test.items()}))
        object.__setattr__(self, "features", MappingProxyType(dict(sorted(schema.items()))))
        if not test and self.test_split == "examples":  # said where a fleet run prints and records its data
            largest = max(lazy.sizes.values() if lazy is not None else map(_num_examples, train.values()))
            why = (
                "each client's one example stays for training"
                if largest == 1
                else f"test_fraction holds out none of a client's examples, {largest} at most"
            )
            note = f"no test split, so no accuracy: {why}; test_split=clients holds out whole clients"
            object.__setattr__(self, "test_note", note)
        if not test and self.test_split in ("files", "central"):  # put aside, a run measured no accuracy
            raise DataLayoutError(
                f"{self.source or 'the dataset'}: its test split holds no example; write the test examples, or leave "
                "the test split out to cut one from the training clients (test_split=, test_fraction=)"
            )
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
        if isinstance(clients, LazyClients):
            return dict(clients.sizes)
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
            self.train.renamed(names) if isinstance(self.train, LazyClients) else rename(self.train),
            rename(self.test),
            label=None if self.label is None else names.get(self.label, self.label),
            test_split=self.test_split,
            source=self.source,
            vocabulary=self.vocabulary,
        )
        object.__setattr__(out, "label_names", self.label_names)  # the label's ids are already encoded
        object.__setattr__(out, "test_note", self.test_note)
        return out

    def values(self, feature: str) -> np.ndarray:
        """One feature's values over both splits, training clients first (client order): the label's
        of a lazily read dataset without reading its other features."""
        parts = []
        for clients in (self.train, self.test):
            if isinstance(clients, LazyClients) and feature == clients.label:
                parts += [clients.labels[c] for c in clients]
            else:
                parts += [e[feature] for e in clients.values()]
        return np.concatenate(parts) if parts else np.zeros(0)

    def describe(self) -> str:
        """One line: clients, examples, features and where the test split comes from."""
        feats = ", ".join(f"{n} {s.dtype}{list(s.shape)}" for n, s in self.features.items())
        return (
            f"{self.source + ': ' if self.source else ''}{len(self.train)} clients, {self.num_examples('train')} training "
            f"examples; test: {len(self.test)} clients, {self.num_examples('test')} examples ({self.test_split}); "
            f"features {feats}"
            + (f"; label {self.label}" if self.label else "")
            + (f" ({len(self.label_names)} classes named in the files)" if self.label_names else "")
            + (f"; {self.test_note}" if self.test_note else "")
        )


def named_labels(data: FederatedDataset, names: tuple[str, ...]) -> FederatedDataset:
    """``data``, whose label already holds class ids, with the name of each id (``label_names``):
    a ``datasets`` ``ClassLabel``'s names."""
    object.__setattr__(data, "label_names", tuple(names))
    return data


def label_names(label: str, *splits: Mapping[str, Examples]) -> tuple[str, ...]:
    """The sorted names of a text label over every split (``datasets``' ``class_encode_column`` order)."""
    return tuple(
        sorted({str(v) for clients in splits for examples in clients.values() for v in examples[label].ravel()})
    )


def label_ids(text: np.ndarray, ids: Mapping[str, int]) -> np.ndarray:
    """Text label values as their ids among the names (``ids``: name -> id)."""
    return np.fromiter((ids[str(v)] for v in text.ravel()), np.int64, text.size).reshape(text.shape)


def encode_label(label: str, names: tuple[str, ...], *splits: dict[str, dict[str, np.ndarray]]) -> tuple[str, ...]:
    """Text labels replaced, in place, by their ids among ``names``; the names."""
    ids = {name: i for i, name in enumerate(names)}
    for clients in splits:
        for examples in clients.values():
            examples[label] = label_ids(examples[label], ids)
    return names


def check_test_schema(test: Mapping[str, FeatureSpec], train: Mapping[str, FeatureSpec]) -> None:
    if test != train:
        raise DataLayoutError(
            f"the test split's features {_describe(test)} differ from the training split's {_describe(train)}"
        )


def _describe(schema: Mapping[str, FeatureSpec]) -> str:
    return "{" + ", ".join(f"{n}: {s.dtype}{list(s.shape)}" for n, s in sorted(schema.items())) + "}"


def _num_examples(examples: Examples) -> int:
    return int(next(iter(examples.values())).shape[0])


def _client_rng(seed: int, client: str) -> np.random.Generator:
    """A client's own stream: its split does not depend on which other clients exist."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(client.encode("utf-8"))])


def take(examples: Examples, index: np.ndarray) -> dict[str, np.ndarray]:
    return {name: array[index] for name, array in examples.items()}


def check_fraction(fraction: float) -> None:
    if not 0.0 < fraction < 1.0:
        raise PartitionError(f"test_fraction must be between 0 and 1 (exclusive), got {fraction}")


def example_split(client: str, n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted indices of a client's ``n`` examples that ``split_examples`` keeps for training
    and holds out for testing: at least one training example, ``floor((1 - fraction) * n)`` of them
    otherwise, drawn from the client's own stream."""
    order = _client_rng(seed, client).permutation(n)
    n_train = max(1, math.floor((1.0 - fraction) * n + 1e-9))
    return np.sort(order[:n_train]), np.sort(order[n_train:])


def split_examples(
    clients: Mapping[str, Examples], fraction: float, seed: int
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    """Each client's examples cut into train and test, as LEAF's ``--by_sample`` split does
    (``example_split``)."""
    check_fraction(fraction)
    train: dict[str, dict[str, np.ndarray]] = {}
    test: dict[str, dict[str, np.ndarray]] = {}
    for cid in sorted(clients):
        examples = clients[cid]
        kept, held = example_split(cid, _num_examples(examples), fraction, seed)
        train[cid] = take(examples, kept)
        if len(held):
            test[cid] = take(examples, held)
    return train, test


def split_clients(
    clients: Mapping[str, Examples], fraction: float, seed: int
) -> tuple[dict[str, Examples], dict[str, Examples]]:
    """Whole clients held out for testing (LEAF's ``--by_user``): ``round(fraction * k)`` of them,
    at least one and never all."""
    held = held_clients(sorted(clients), fraction, seed)
    return {c: clients[c] for c in sorted(clients) if c not in held}, {
        c: clients[c] for c in sorted(clients) if c in held
    }


def held_clients(ids: list[str], fraction: float, seed: int) -> set[str]:
    """The clients of ``ids`` (sorted) that ``split_clients`` holds out."""
    check_fraction(fraction)
    if len(ids) < 2:
        raise PartitionError(f"holding out clients needs at least 2 clients, got {len(ids)}; use test_split=examples")
    n_test = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    order = np.random.default_rng(int(seed) & 0xFFFFFFFF).permutation(len(ids))
    return {ids[i] for i in order[:n_test]}


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
