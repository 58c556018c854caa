"""A table with a client-id column: Parquet, CSV, or a Hugging Face ``datasets`` dataset saved with
``save_to_disk``, read with pyarrow (and ``datasets`` for the saved folder).

Each row is one example; the client column says whose it is (flwr-datasets' ``NaturalIdPartitioner``
does the same with a column); every other column is a feature (``features=a+b`` keeps some). A
column of numbers is a scalar feature, a column of equal-length lists (Parquet list columns, a
``datasets`` ``Sequence``) a vector or tensor, a column of strings a text feature (dtype ``"str"``).
Rows keep their order within a client. A saved ``DatasetDict`` brings its ``train`` and ``test``
splits; otherwise ``test=`` names a second table, or the test split is cut as ``load_leaf`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ._dataset import FederatedDataset, with_test_split
from ._errors import DataLayoutError, DataSpecError, require

_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _read_arrow(path: Path, client: str) -> tuple[Any, Any | None]:
    """(train table, test table or None) as pyarrow Tables."""
    if not path.exists():
        raise DataSpecError(f"table: {path} does not exist")
    if path.is_dir():
        if not any((path / m).is_file() for m in _HF_MARKERS):
            raise DataLayoutError(
                f"table: {path} is a folder without {', '.join(_HF_MARKERS)}; "
                "give a .parquet or .csv file or a folder written by datasets' save_to_disk"
            )
        datasets: Any = require("datasets")
        try:
            saved = datasets.load_from_disk(str(path))
        except Exception as exc:  # datasets raises many types for a damaged folder
            raise DataLayoutError(f"table: {path} could not be read as a saved datasets folder ({exc})") from exc
        if isinstance(saved, datasets.DatasetDict):
            if "train" not in saved:
                raise DataLayoutError(f"table: {path} holds splits {sorted(saved)} but no 'train' split")
            test = saved["test"].with_format("arrow")[:] if "test" in saved else None
            return saved["train"].with_format("arrow")[:], test
        return saved.with_format("arrow")[:], None
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        pq: Any = require("pyarrow.parquet")
        try:
            return pq.ParquetFile(path).read(), None  # one file (read_table's dataset reader refuses a name twice)
        except Exception as exc:  # pyarrow's ArrowInvalid and OSError for a file that is not Parquet
            raise DataLayoutError(f"table: {path} is not a Parquet file ({exc})") from exc
    if suffix == ".csv":
        pa: Any = require("pyarrow")
        csv: Any = require("pyarrow.csv")
        try:  # client ids stay text: "007" is not 7
            table = csv.read_csv(path, convert_options=csv.ConvertOptions(column_types={client: pa.string()}))
            _ = table.column_names  # the header's names are decoded here, not when the file is read
        except UnicodeDecodeError as exc:
            raise DataLayoutError(
                f"table: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
            ) from None
        except Exception as exc:
            raise DataLayoutError(f"table: {path} could not be read as CSV ({exc})") from exc
        return table, None
    raise DataSpecError(f"table: {path} is neither .parquet, .csv nor a datasets folder; convert it to one of them")


def _column(table: Any, name: str, where: str) -> np.ndarray:
    pa: Any = require("pyarrow")
    col = table.column(name)
    if col.null_count:
        raise DataLayoutError(
            f"table: {where}: column {name!r} has {col.null_count} missing values; fill or drop those rows"
        )
    kind = col.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return np.asarray(col.to_pylist(), dtype=object)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return np.asarray(col.to_numpy())
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        try:
            return np.asarray(col.to_pylist())
        except ValueError as exc:
            raise DataLayoutError(
                f"table: {where}: column {name!r} holds lists of different lengths; pad them to one length"
            ) from exc
    raise DataLayoutError(
        f"table: {where}: column {name!r} has type {kind}, which is not a number, string or list; "
        "decode it (images to arrays) before loading"
    )


def group_by_client(
    table: Any, client: str, features: Sequence[str] | None, where: str
) -> dict[str, dict[str, np.ndarray]]:
    """Rows grouped by the client column, keeping their order within each client."""
    columns = list(table.column_names)
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if twice:
        raise DataLayoutError(
            f"table: {where} has the column {twice[0]!r} more than once; give each column its own name"
        )
    if client not in columns:
        raise DataSpecError(f"table: {where} has no client column {client!r}; its columns are {', '.join(columns)}")
    names = [c for c in columns if c != client] if features is None else list(features)
    missing = [n for n in names if n not in columns]
    if missing:
        raise DataSpecError(f"table: {where} has no column {missing[0]!r}; its columns are {', '.join(columns)}")
    if not names:
        raise DataLayoutError(f"table: {where} has no feature column besides the client column {client!r}")
    if table.column(client).null_count:
        raise DataLayoutError(f"table: {where}: client column {client!r} has missing values; every row needs a client")
    ids = np.asarray([str(v) for v in table.column(client).to_pylist()], dtype=object)
    if (ids == "").any():  # a CSV's empty cell: text, not null, but no client's id either
        raise DataLayoutError(
            f"table: {where}: client column {client!r} has {int((ids == '').sum())} empty ids; every row needs a client"
        )
    arrays = {n: _column(table, n, where) for n in names}
    order = np.argsort(ids.astype(str), kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]) if len(ids) else np.zeros(0, dtype=np.int64)
    bounds = np.r_[starts, len(ids)]
    return {str(sorted_ids[s]): {n: a[order[s:e]] for n, a in arrays.items()} for s, e in zip(bounds[:-1], bounds[1:])}


def load_table(
    path: str | Path,
    *,
    client: str,
    test: str | Path | None = None,
    label: str | None = None,
    features: Sequence[str] | None = None,
    test_split: Literal["examples", "clients"] = "examples",
    test_fraction: float = 0.1,
    seed: int = 0,
) -> FederatedDataset:
    """A table of examples with a client column (``client``) as a federated dataset."""
    path = Path(path)
    train_table, test_table = _read_arrow(path, client)
    train = group_by_client(train_table, client, features, str(path))
    if test is not None:
        test_table, _ = _read_arrow(Path(test), client)
    if label is None:
        label = next((n for n in ("label", "y") if n in next(iter(train.values()), {})), None)
    source = f"table:{path}"
    if test_table is not None:
        test_clients = group_by_client(test_table, client, features, str(test or path))
        return FederatedDataset(train, test_clients, label=label, test_split="files", source=source)
    if not train:
        raise DataLayoutError(f"table: {path} has no rows")
    return with_test_split(train, how=test_split, fraction=test_fraction, seed=seed, label=label, source=source)
