"""TFF's ClientData HDF5 layout (``tff.simulation.datasets.HDF5ClientData``), read with h5py.

A file holds a top-level group ``examples`` with one subgroup per client, named by the client id,
and in it one dataset per feature whose first axis is the example: TFF's federated EMNIST
(``fed_emnist_train.h5``/``_test.h5``: ``pixels`` float32 [28, 28], ``label`` int32) and
StackOverflow (``stackoverflow_train.h5``, ``_held_out.h5``, ``_test.h5``: ``tokens``, ``title``,
``tags``, ``type``, ``creation_date`` strings and ``score`` int64; ``tokens`` space-separated,
``tags`` '|'-separated). As in TFF, clients come in sorted order and features by name; strings are
decoded to Python ``str`` (feature dtype ``"str"``: tokenize them with ``text.encode_words``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

from ._dataset import FederatedDataset, with_test_split
from ._errors import DataLayoutError, DataSpecError, require

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


def _read_feature(dataset: Any, h5py: Any) -> np.ndarray:
    if h5py.check_string_dtype(dataset.dtype) is not None:
        return np.asarray(dataset.asstr()[()], dtype=object)
    if dataset.dtype.kind == "O":  # variable-length bytes without a declared string type
        return np.asarray([v.decode("utf-8") if isinstance(v, bytes) else v for v in dataset[()]], dtype=object)
    return np.asarray(dataset[()])


def read_tff_h5(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Client id -> feature -> array from one TFF ClientData HDF5 file."""
    h5py: Any = require("h5py")
    if not path.is_file():
        raise DataSpecError(f"tff-h5: {path} does not exist")
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise DataLayoutError(f"tff-h5: {path} is not an HDF5 file ({exc}); TFF's ClientData files are HDF5") from exc
    with handle as f:
        if EXAMPLES_GROUP not in f or not isinstance(f[EXAMPLES_GROUP], h5py.Group):
            raise DataLayoutError(
                f"tff-h5: {path} has no {EXAMPLES_GROUP!r} group (top level: {', '.join(sorted(f.keys())) or 'nothing'}); "
                "a TFF ClientData file holds examples/<client id>/<feature>"
            )
        examples = f[EXAMPLES_GROUP]
        out: dict[str, dict[str, np.ndarray]] = {}
        for cid in sorted(examples.keys()):
            group = examples[cid]
            if not isinstance(group, h5py.Group):
                raise DataLayoutError(
                    f"tff-h5: {path}: examples/{cid} is a dataset, not a client group; "
                    "a TFF ClientData file holds examples/<client id>/<feature>"
                )
            features = {}
            for name in sorted(group.keys()):
                if not isinstance(group[name], h5py.Dataset):
                    raise DataLayoutError(
                        f"tff-h5: {path}: examples/{cid}/{name} is a group; each feature must be a dataset"
                    )
                features[name] = _read_feature(group[name], h5py)
            out[cid] = features
    if not out:
        raise DataLayoutError(f"tff-h5: {path}'s examples group holds no clients")
    return out


def load_tff_h5(
    path: str | Path,
    *,
    test: str | Path | None = None,
    label: str | None = None,
    test_split: Literal["examples", "clients"] = "examples",
    test_fraction: float = 0.1,
    seed: int = 0,
) -> FederatedDataset:
    """A TFF ClientData HDF5 file (or a folder with a ``*train*.h5`` and a ``*test*.h5``).

    ``label`` defaults to the feature named ``label`` or ``y`` if there is one. Without a test file
    the test split is cut from the training clients, as ``load_leaf`` does.
    """
    path = Path(path)
    test_path = Path(test) if test is not None else None
    if path.is_dir():
        path, found = _pair_in_folder(path)
        test_path = test_path or found
    train = read_tff_h5(path)
    features = next(iter(train.values()))
    if label is None:
        label = next((n for n in ("label", "y") if n in features), None)
    source = f"tff-h5:{path}"
    if test_path is not None:
        return FederatedDataset(train, read_tff_h5(test_path), label=label, test_split="files", source=source)
    return with_test_split(train, how=test_split, fraction=test_fraction, seed=seed, label=label, source=source)
