"""TFF's ClientData HDF5 layout (``tff.simulation.datasets.HDF5ClientData``), read with h5py.

A file holds a top-level group ``examples`` with one subgroup per client, named by the client id,
and in it one dataset per feature whose first axis is the example: TFF's federated EMNIST
(``fed_emnist_train.h5``/``_test.h5``: ``pixels`` float32 [28, 28], ``label`` int32) and
StackOverflow (``stackoverflow_train.h5``, ``_held_out.h5``, ``_test.h5``: ``tokens``, ``title``,
``tags``, ``type``, ``creation_date`` strings and ``score`` int64; ``tokens`` space-separated,
``tags`` '|'-separated). As in TFF, clients come in sorted order and features by name; strings are
decoded to Python ``str`` (feature dtype ``"str"``), or read as word ids (``words=tokens+title``).

The clients and their features are found in one walk over the file's links (HDF5's own recursion),
and each feature is read through h5py's low-level dataset API: a file of 20,000 clients spent most
of its time in h5py's objects for each group, link and dataset. The training file is read lazily
by default (``lazy``): its clients' shapes and dtypes are read up front, the features whose values
are checked (floats: finite) or summarized (the label, a vocabulary's texts) are read once, one
client at a time, and a client's examples are read again when first asked for (a device built).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ._dataset import (
    STR,
    FeatureSpec,
    FederatedDataset,
    LazyClients,
    check_client,
    check_clients,
    check_fraction,
    check_test_schema,
    encode_label,
    example_split,
    held_clients,
    label_ids,
    label_names,
    take,
    with_test_split,
)
from ._errors import DataLayoutError, DataSpecError, check_finite, check_fits, check_link, check_readable, require
from .text import LEAF_CHARACTERS, CharWindows, WordIds, count_words, id_dtype

EXAMPLES_GROUP = "examples"
#: Numeric dtype kinds read through the low-level API (strings and the rest go through h5py's
#: ``Dataset``, which decodes them).
_PLAIN_KINDS = frozenset("biufc")


def _pair_in_folder(folder: Path) -> tuple[Path, Path | None]:
    check_readable(folder, "tff-h5: ")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".h5", ".hdf5") and not p.name.startswith("."))
    for p in files:
        check_link(p, "tff-h5: ")
    train = [p for p in files if "train" in p.stem]
    test = [p for p in files if "test" in p.stem]
    if len(train) != 1 or len(test) > 1:
        raise DataLayoutError(
            f"tff-h5: {folder} must hold one *train*.h5 file and at most one *test*.h5 file, found "
            f"{', '.join(p.name for p in files) or 'no .h5 files'}; or name the file itself"
        )
    return train[0], (test[0] if test else None)


def _member(group: Any, name: str, h5py: Any, where: str) -> Any:
    """``group[name]``, unless it is a link to another file (a hostile file's external link makes
    h5py open whatever path it names) or a link to nothing: a ``DataLayoutError`` naming it."""
    link = group.get(name, getlink=True)
    if isinstance(link, h5py.ExternalLink):
        raise DataLayoutError(
            f"{where} links to {link.filename!r} ({link.path}), another file; a ClientData file holds its own data"
        )
    try:
        return group[name]
    except KeyError:
        raise DataLayoutError(f"{where} is a link to nothing in the file") from None


def _read(dataset: Any, h5py: Any) -> np.ndarray:
    if h5py.check_string_dtype(dataset.dtype) is not None:
        return np.asarray(dataset.asstr()[()], dtype=object)
    if dataset.dtype.kind == "O":  # variable-length bytes without a declared string type
        return np.asarray([v.decode("utf-8") if isinstance(v, bytes) else v for v in dataset[()]], dtype=object)
    return np.asarray(dataset[()])


class ClientFile:
    """One ClientData file: its clients (sorted) and their features, found with one walk over the
    links under ``examples``, where a link to another file is refused; a client that is not a group
    of plain links (a soft link, a dataset, an empty group) is looked up through h5py's objects.
    Open it with ``with``; ``read(client)`` reopens it when it is closed."""

    def __init__(self, path: Path) -> None:
        self.h5py: Any = require("h5py")
        self.path = path
        self.where = f"tff-h5: {path}: {EXAMPLES_GROUP}"
        if not path.is_file():
            raise DataSpecError(
                f"tff-h5: {path} {'is not a regular file' if path.exists() else 'does not exist'}; give an .h5 file or "
                "a folder with *train*.h5"
            )
        check_readable(path, "tff-h5: ")
        self._file: Any = None
        with self:
            self.clients = self._walk()
        if not self.clients:
            raise DataLayoutError(f"tff-h5: {path}'s examples group holds no clients")

    def __enter__(self) -> ClientFile:
        h5py = self.h5py
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as exc:
            cut = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", str(exc))
            if cut:  # HDF5 knows the size it wrote: a copy or download that stopped early
                raise DataLayoutError(
                    f"tff-h5: {self.path} is cut short: {int(cut[1]):,} of the {int(cut[2]):,} bytes HDF5 wrote; copy "
                    "or download it again"
                ) from None
            raise DataLayoutError(
                f"tff-h5: {self.path} is not an HDF5 file ({exc}); TFF's ClientData files are HDF5"
            ) from exc
        f = self._file
        if EXAMPLES_GROUP in f.keys():
            _member(f, EXAMPLES_GROUP, h5py, f"tff-h5: {self.path}: {EXAMPLES_GROUP}")
        if EXAMPLES_GROUP not in f or not isinstance(f[EXAMPLES_GROUP], h5py.Group):
            raise DataLayoutError(
                f"tff-h5: {self.path} has no {EXAMPLES_GROUP!r} group (top level: "
                f"{', '.join(sorted(f.keys())) or 'nothing'}); a TFF ClientData file holds examples/<client id>/<feature>"
            )
        self.examples = f[EXAMPLES_GROUP]
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()
        self._file = None

    def _walk(self) -> dict[str, tuple[str, ...] | None]:
        """Client id -> its feature names (sorted); None for a client looked up through h5py's objects."""
        h5py, links = self.h5py, self.examples.id.links
        found: list[tuple[bytes, int]] = []
        links.visit(lambda name, info: found.append((name, info.type)), info=True)  # hard-linked groups only
        layout: dict[str, list[str] | None] = {}
        for raw, kind in found:
            name = raw.decode("utf-8", "surrogateescape")
            if kind == h5py.h5l.TYPE_EXTERNAL:
                filename, target = (v.decode("utf-8", "surrogateescape") for v in links.get_val(raw))
                raise DataLayoutError(
                    f"{self.where}/{name} links to {filename!r} ({target}), another file; a ClientData file holds "
                    "its own data"
                )
            cid, _, feature = name.partition("/")
            if not feature:
                layout[cid] = [] if kind == h5py.h5l.TYPE_HARD else None
            elif "/" not in feature:
                features = layout[cid]
                if features is not None:
                    features.append(feature)
        # a group with no feature, or a dataset: h5py's objects say which
        return {c: (tuple(sorted(f)) if f else None) for c, f in sorted(layout.items())}

    def _group(self, cid: str) -> Any:
        group = _member(self.examples, cid, self.h5py, f"{self.where}/{cid}")
        if not isinstance(group, self.h5py.Group):
            raise DataLayoutError(
                f"{self.where}/{cid} is a dataset, not a client group; a TFF ClientData file holds "
                "examples/<client id>/<feature>"
            )
        return group

    def features(self, cid: str) -> tuple[str, ...]:
        names = self.clients[cid]
        return names if names is not None else tuple(sorted(self._group(cid).keys()))

    def _dataset(self, cid: str, group: Any, name: str) -> Any:
        """The feature's dataset: a low-level ``DatasetID`` for a plain link (``group``: the client's
        ``GroupID``), else h5py's ``Dataset``."""
        h5py = self.h5py
        if group is not None:
            try:
                return h5py.h5d.open(group, name.encode("utf-8", "surrogateescape"))
            except KeyError:  # a group, or a soft link to nothing: h5py's objects say which
                pass
        where = f"{self.where}/{cid}/{name}"
        member = _member(self._group(cid), name, h5py, where)
        if not isinstance(member, h5py.Dataset):
            raise DataLayoutError(
                f"{where} is a group; a TFF ClientData file holds examples/<client id>/<feature> with each "
                f"feature a dataset: move the datasets inside it up to {EXAMPLES_GROUP}/{cid}/ (h5py's Group.move), "
                f"or, if {cid}/{name} is one client's id, write it without '/', which HDF5 reads as a group's path"
            )
        return member

    def datasets(self, cid: str) -> dict[str, Declared]:
        """The client's features as the file declares them, nothing read."""
        group = None
        if self.clients[cid] is not None:  # a group of plain links: opened once, its features by name
            group = self.h5py.h5g.open(self.examples.id, cid.encode("utf-8", "surrogateescape"))
        out = {}
        for name in self.features(cid):
            dataset = self._dataset(cid, group, name)
            shape = dataset.shape
            out[name] = Declared(f"{self.where}/{cid}/{name}", dataset, dataset.dtype, () if shape is None else shape)
        return out

    def read(self, cid: str) -> dict[str, np.ndarray]:
        """The client's features, each once its declared size fits in memory and its floats are finite."""
        if self._file is None:
            with self:
                return self.read(cid)
        return {name: declared.read(self.h5py) for name, declared in self.datasets(cid).items()}


@dataclass(frozen=True)
class Declared:
    """A feature's dataset (``where`` names it in errors) with its declared dtype and shape."""

    where: str
    dataset: Any
    dtype: np.dtype
    shape: tuple[int, ...]

    def check(self, h5py: Any) -> Any:
        """The base type of a variable-length dtype (``bytes`` or ``str`` for TFF's texts), or None;
        variable-length numbers (ragged token ids) are refused, as no one shape holds them."""
        vlen = h5py.check_vlen_dtype(self.dtype)
        if vlen is not None and vlen not in (bytes, str):
            raise DataLayoutError(
                f"{self.where} holds sequences of {np.dtype(vlen)} of different lengths (an HDF5 variable-length "
                "type); write each example padded to one length, as TFF's files hold fixed shapes and texts"
            )
        text = vlen is not None or h5py.check_string_dtype(self.dtype) is not None or self.dtype.kind == "S"
        if not text and self.dtype.kind not in "biuf":  # a compound's fields, complex numbers, references
            raise DataLayoutError(
                f"{self.where} holds {_described(self.dtype)} values; a feature holds numbers or text, as a "
                "plan's inputs do: write each field (or the real and imaginary parts) as a feature of its own"
            )
        return vlen

    def read(self, h5py: Any) -> np.ndarray:
        """The array, once its declared size fits in memory (a dataset is declared with any shape:
        10**6 x 10**6 floats take no space unwritten, and reading one past memory was a
        ``MemoryError`` that named nothing) and its floats are finite, as a LEAF file's and a
        table's are."""
        dtype, shape, dataset = self.dtype, self.shape, self.dataset
        size = check_fits(self.where, dtype, shape, dtype.itemsize)
        vlen = self.check(h5py)
        low_level = isinstance(dataset, h5py.h5d.DatasetID)
        text = low_level and vlen in (bytes, str)  # TFF's strings
        try:
            if text or (low_level and dtype.kind in _PLAIN_KINDS and dtype.metadata is None):
                values = np.empty(shape, dtype)  # read without h5py's Dataset around it
                if values.size:
                    dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, values)
                if text:
                    decoded = [v.decode("utf-8") if isinstance(v, bytes) else v for v in values.ravel()]
                    values = np.array(decoded, dtype=object).reshape(shape)
            else:
                values = _read(dataset if isinstance(dataset, h5py.Dataset) else h5py.Dataset(dataset), h5py)
        except MemoryError:
            raise DataLayoutError(
                f"{self.where} ({dtype}{list(shape)}, {size / 2**30:.4g} GiB) does not fit in memory"
            ) from None
        except UnicodeDecodeError as exc:
            raise DataLayoutError(
                f"{self.where} holds text that is not UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
        return check_finite(values, self.where)


def _described(dtype: np.dtype) -> str:
    if dtype.names:
        return f"compound ({', '.join(dtype.names)})"
    return {"O": "object reference", "V": f"opaque {dtype}"}.get(dtype.kind, dtype.name)


def read_tff_h5(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Client id -> feature -> array from one TFF ClientData HDF5 file."""
    reader = ClientFile(path)
    with reader:
        return {cid: reader.read(cid) for cid in reader.clients}


def load_tff_h5(
    path: str | Path,
    *,
    test: str | Path | None = None,
    label: str | None = None,
    words: WordIds | None = None,
    test_split: Literal["examples", "clients"] = "examples",
    test_fraction: float = 0.1,
    seed: int = 0,
    lazy: bool = True,
    chars: CharWindows | None = None,
) -> FederatedDataset:
    """A TFF ClientData HDF5 file (or a folder with a ``*train*.h5`` and a ``*test*.h5``).

    ``label`` defaults to the feature named ``label`` or ``y`` if there is one. ``words`` names text
    features to read as word ids (StackOverflow's ``tokens``, ``title``: ``text.WordIds``).
    Without a test file the test split is cut from the training clients, as ``load_leaf`` does.
    ``lazy``: the training clients' examples are read when first asked for (the same arrays as
    ``lazy=False``, which reads them all now); the test split is read now either way. ``chars``
    cuts a text feature into next-character examples ``x`` and ``y`` (TFF's Shakespeare snippets:
    ``text.CharWindows``), its texts read now.
    """
    path = Path(path)
    test_path = Path(test) if test is not None else None
    if path.is_dir():
        path, found = _pair_in_folder(path)
        test_path = test_path or found
    if chars is not None:
        if label is not None or words is not None:
            raise DataSpecError(
                f"tff-h5: chars={chars.feature} makes the features x and y (the next character, the label); "
                "leave out label= and words="
            )
        where = "tff-h5: "
        windows = chars.cut(read_tff_h5(path), where)
        if not windows:
            raise DataLayoutError(
                f"tff-h5: {path}: no client's {chars.feature} hold more than {chars.window} characters; lower window="
            )
        test_windows = chars.cut(read_tff_h5(test_path), where) if test_path is not None else None
        return with_test_split(
            windows,
            test=test_windows,
            how=test_split,
            fraction=test_fraction,
            seed=seed,
            label="y",
            source=f"tff-h5:{path} ({chars.feature} as {chars.window}-character windows)",
            vocabulary=tuple(LEAF_CHARACTERS),
        )
    if lazy:
        return _load_lazily(path, test_path, label, words, test_split, test_fraction, seed)
    train = read_tff_h5(path)
    test_clients = read_tff_h5(test_path) if test_path is not None else None
    if test_clients is not None and not check_clients(test_clients, "test")[0]:
        raise DataLayoutError(_no_test_examples(test_path))
    features = next(iter(train.values()))
    if label is None:
        label = next((n for n in ("label", "y") if n in features), None)
    vocabulary = words.encode(train, test_clients or {}, "tff-h5: ") if words is not None else ()
    return with_test_split(
        train,
        test=test_clients,
        how=test_split,
        fraction=test_fraction,
        seed=seed,
        label=label,
        source=f"tff-h5:{path}",
        vocabulary=vocabulary,
    )


def _no_test_examples(path: Path | None) -> str:
    return (
        f"tff-h5: the test file {path} holds no client with examples; write the test examples there, or leave it "
        "out to cut a test split from the training clients (test_split=, test_fraction=)"
    )


def _dtype_name(dtype: np.dtype, h5py: Any) -> str:
    """A declared dtype's name as a read array's (``_dataset.FeatureSpec``): text is ``str``."""
    text = h5py.check_string_dtype(dtype) is not None or dtype.kind in "OSU"
    return STR if text else dtype.name


def _load_lazily(
    path: Path,
    test_path: Path | None,
    label: str | None,
    words: WordIds | None,
    how: Literal["examples", "clients"],
    fraction: float,
    seed: int,
) -> FederatedDataset:
    """``load_tff_h5`` with the training clients' examples read when first asked for. Up front, in
    one pass over the clients: the training file's declarations (checked as ``check_clients`` checks
    arrays, and against memory), and the features a read must check or the dataset summarizes
    (floats, the label, the texts of ``words`` without a vocabulary), with the rows of the test
    split when it is cut from the training clients. A client's arrays are then what ``lazy=False``
    gives."""
    reader = ClientFile(path)
    h5py = reader.h5py
    source = f"tff-h5:{path}"
    if how not in ("examples", "clients"):
        raise DataSpecError(f"test_split must be 'examples' or 'clients', got {how!r}")
    test_clients = read_tff_h5(test_path) if test_path is not None else None
    cut_examples = test_clients is None and how == "examples"  # every client's test rows are read now
    if cut_examples:
        check_fraction(fraction)
    names: dict[np.dtype, str] = {}
    schema: dict[str, FeatureSpec] = {}
    sizes: dict[str, int] = {}  # examples in the file
    training: dict[str, int] = {}  # examples in the training split
    labels: dict[str, np.ndarray] = {}
    counts: Counter[str] = Counter()  # the words of the texts a vocabulary is built from
    cut: dict[str, dict[str, np.ndarray]] = {}
    read_now: set[str] = set()
    first: str | None = None
    with reader:
        for cid in reader.clients:
            declared = reader.datasets(cid)
            shapes = {}
            for name, d in declared.items():
                check_fits(d.where, d.dtype, d.shape, d.dtype.itemsize)
                d.check(h5py)
                kind = names.get(d.dtype)
                if kind is None:
                    kind = names[d.dtype] = _dtype_name(d.dtype, h5py)
                shapes[name] = (kind, d.shape)
            sizes[cid] = check_client(cid, shapes, schema, first, "train")
            if not sizes[cid]:
                continue
            if first is None:  # the schema is known: what to read of every client follows
                first = cid
                if label is None:
                    label = next((n for n in ("label", "y") if n in schema), None)
                if label is not None and label not in schema:
                    raise DataLayoutError(f"label {label!r} is not a feature; the features are {sorted(schema)}")
                if words is not None:
                    words.check({n: s.dtype for n, s in schema.items()}, "tff-h5: ")
                    several = next((n for n in words.features if schema[n].shape), None)
                    if several is not None:
                        raise DataLayoutError(
                            f"tff-h5: words={several}: feature {several!r} holds more than one text per example"
                        )
                read_now = {n for n, s in schema.items() if s.dtype.startswith(("float", "complex"))}
                read_now |= {label} if label else set()
                read_now |= set(words.features) if words is not None and words.vocab is None else set()
            examples = {n: d.read(h5py) for n, d in declared.items() if cut_examples or n in read_now}
            if words is not None and words.vocab is None:
                count_words((str(t) for n in words.features for t in examples[n].ravel()), counts, words.split)
            kept = None
            if cut_examples:
                kept, held = example_split(cid, sizes[cid], fraction, seed)
                if len(held):
                    cut[cid] = take(examples, held)
            training[cid] = sizes[cid] if kept is None else len(kept)
            if label:
                labels[cid] = examples[label] if kept is None else examples[label][kept]
        if first is None:
            raise DataLayoutError(f"{source} has no client with training examples")
        if test_clients is None and how == "clients":
            for cid in sorted(held_clients(list(training), fraction, seed)):
                cut[cid] = reader.read(cid)
                del training[cid]
                labels.pop(cid, None)
    test = test_clients if test_clients is not None else cut
    if test_clients is not None:  # before its text is encoded: the files' own features
        read_test, test_schema = check_clients(test_clients, "test")
        if not read_test:
            raise DataLayoutError(_no_test_examples(test_path))
        check_test_schema(test_schema, schema)
    vocabulary: tuple[str, ...] = ()
    if words is not None:
        vocabulary = words.vocabulary(lambda: counts)
        for examples in test.values():
            words.encode_examples(examples, vocabulary, "tff-h5: ")
    features = dict(schema)
    if words is not None:
        held_as = id_dtype(len(vocabulary) + 1).name  # as encode_words holds them
        features.update({name: FeatureSpec(held_as, (words.max_words,)) for name in words.features})
    classes: tuple[str, ...] = ()
    if label is not None and schema[label].dtype == STR:
        classes = label_names(label, {c: {label: v} for c, v in labels.items()}, test)
        ids = {name: i for i, name in enumerate(classes)}
        labels = {c: label_ids(v, ids) for c, v in labels.items()}
        encode_label(label, classes, test)
        features[label] = FeatureSpec("int64", schema[label].shape)

    def rows(cid: str) -> np.ndarray | None:
        """The client's training rows (None: all of them)."""
        return example_split(cid, sizes[cid], fraction, seed)[0] if cut_examples else None

    read = _lazy_reader(reader, training, rows, words, vocabulary, label, classes)
    lazy = LazyClients(training, features, read, label=label, labels=labels, label_names=classes)
    split = "files" if test_clients is not None else how
    return FederatedDataset(lazy, test, label=label, test_split=split, source=source, vocabulary=vocabulary)


def _lazy_reader(
    reader: ClientFile,
    sizes: dict[str, int],
    rows: Callable[[str], np.ndarray | None],
    words: WordIds | None,
    vocabulary: tuple[str, ...],
    label: str | None,
    names: tuple[str, ...],
) -> Callable[[str], dict[str, np.ndarray]]:
    ids = {name: i for i, name in enumerate(names)}

    def read(cid: str) -> dict[str, np.ndarray]:
        examples = reader.read(cid)
        index = rows(cid)
        if index is not None:
            examples = take(examples, index)
        if words is not None:
            words.encode_examples(examples, vocabulary, "tff-h5: ")
        if names and label is not None:
            examples[label] = label_ids(examples[label], ids)
        counts = {len(a) for a in examples.values()}
        if counts != {sizes[cid]}:
            raise DataLayoutError(
                f"{reader.where}/{cid} holds {sorted(counts)} examples where it held {sizes[cid]} when the file was "
                "loaded; the file changed under the run: load it again"
            )
        return examples

    return read
