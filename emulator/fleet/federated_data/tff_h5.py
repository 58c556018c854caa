"""TFF's ClientData HDF5 layout (``tff.simulation.datasets.HDF5ClientData``), read with h5py.

A file holds a top-level group ``examples`` with one subgroup per client, named by the client id,
and in it one dataset per feature whose first axis is the example: TFF's federated EMNIST
(``fed_emnist_train.h5``/``_test.h5``: ``pixels`` float32 [28, 28], ``label`` int32) and
StackOverflow (``stackoverflow_train.h5``, ``_held_out.h5``, ``_test.h5``: ``tokens``, ``title``,
``tags``, ``type``, ``creation_date`` strings and ``score`` int64; ``tokens`` space-separated,
``tags`` '|'-separated). As in TFF, clients come in sorted order and features by name; strings are
decoded to Python ``str`` (feature dtype ``"str"``), or read as word ids (``words=tokens+title``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

from ._dataset import FederatedDataset, with_test_split
from ._errors import DataLayoutError, DataSpecError, check_finite, check_fits, require
from .text import WordIds

EXAMPLES_GROUP = "examples"


def _pair_in_folder(folder: Path) -> tuple[Path, Path | None]:
    files = sorted(p for p in folder.iterdir() if p.suffix in (".h5", ".hdf5"))
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


def _read_feature(dataset: Any, h5py: Any, where: str) -> np.ndarray:
    """The feature's array, once its declared size fits in memory: a dataset is declared with any
    shape (10**6 x 10**6 floats take no space unwritten), and reading one past memory was a
    ``MemoryError`` that named nothing."""
    size = check_fits(where, dataset.dtype, dataset.shape, dataset.dtype.itemsize)
    try:
        values = _read(dataset, h5py)
    except MemoryError:
        raise DataLayoutError(
            f"{where} ({dataset.dtype}{list(dataset.shape)}, {size / 2**30:.4g} GiB) does not fit in memory"
        ) from None
    return check_finite(values, where)  # as a LEAF file's and a table's are refused


def _read(dataset: Any, h5py: Any) -> np.ndarray:
    if h5py.check_string_dtype(dataset.dtype) is not None:
        return np.asarray(dataset.asstr()[()], dtype=object)
    if dataset.dtype.kind == "O":  # variable-length bytes without a declared string type
        return np.asarray([v.decode("utf-8") if isinstance(v, bytes) else v for v in dataset[()]], dtype=object)
    return np.asarray(dataset[()])


def read_tff_h5(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Client id -> feature -> array from one TFF ClientData HDF5 file."""
    h5py: Any = require("h5py")
    if not path.is_file():
        raise DataSpecError(
            f"tff-h5: {path} {'is not a regular file' if path.exists() else 'does not exist'}; give an .h5 file or a "
            "folder with *train*.h5"
        )
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise DataLayoutError(f"tff-h5: {path} is not an HDF5 file ({exc}); TFF's ClientData files are HDF5") from exc
    with handle as f:
        if EXAMPLES_GROUP in f.keys():
            _member(f, EXAMPLES_GROUP, h5py, f"tff-h5: {path}: {EXAMPLES_GROUP}")
        if EXAMPLES_GROUP not in f or not isinstance(f[EXAMPLES_GROUP], h5py.Group):
            raise DataLayoutError(
                f"tff-h5: {path} has no {EXAMPLES_GROUP!r} group (top level: {', '.join(sorted(f.keys())) or 'nothing'}); "
                "a TFF ClientData file holds examples/<client id>/<feature>"
            )
        examples = f[EXAMPLES_GROUP]
        out: dict[str, dict[str, np.ndarray]] = {}
        for cid in sorted(examples.keys()):
            group = _member(examples, cid, h5py, f"tff-h5: {path}: examples/{cid}")
            if not isinstance(group, h5py.Group):
                raise DataLayoutError(
                    f"tff-h5: {path}: examples/{cid} is a dataset, not a client group; "
                    "a TFF ClientData file holds examples/<client id>/<feature>"
                )
            features = {}
            for name in sorted(group.keys()):
                where = f"tff-h5: {path}: examples/{cid}/{name}"
                member = _member(group, name, h5py, where)
                if not isinstance(member, h5py.Dataset):
                    raise DataLayoutError(f"{where} is a group; each feature must be a dataset")
                features[name] = _read_feature(member, h5py, where)
            out[cid] = features
    if not out:
        raise DataLayoutError(f"tff-h5: {path}'s examples group holds no clients")
    return out


def load_tff_h5(
    path: str | Path,
    *,
    test: str | Path | None = None,
    label: str | None = None,
    words: WordIds | None = None,
    test_split: Literal["examples", "clients"] = "examples",
    test_fraction: float = 0.1,
    seed: int = 0,
) -> FederatedDataset:
    """A TFF ClientData HDF5 file (or a folder with a ``*train*.h5`` and a ``*test*.h5``).

    ``label`` defaults to the feature named ``label`` or ``y`` if there is one. ``words`` names text
    features to read as word ids (StackOverflow's ``tokens``, ``title``: ``text.WordIds``).
    Without a test file the test split is cut from the training clients, as ``load_leaf`` does.
    """
    path = Path(path)
    test_path = Path(test) if test is not None else None
    if path.is_dir():
        path, found = _pair_in_folder(path)
        test_path = test_path or found
    train = read_tff_h5(path)
    test_clients = read_tff_h5(test_path) if test_path is not None else None
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
