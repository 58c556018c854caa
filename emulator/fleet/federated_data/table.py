"""A table with a client-id column: Parquet, CSV, or a Hugging Face ``datasets`` dataset saved with
``save_to_disk``, read with pyarrow (and ``datasets`` for the saved folder).

Each row is one example; the client column says whose it is (flwr-datasets' ``NaturalIdPartitioner``
does the same with a column); every other column is a feature (``features=a+b`` keeps some, and
``stack=x`` makes the numeric ones but the label one vector feature ``x``, for a CSV of many). A
column of numbers is a scalar feature, a column of equal-length lists (Parquet list columns, a
``datasets`` ``Sequence``, ``Array2D``) a vector or tensor, read from Arrow's buffers, a column of
strings a text feature (dtype ``"str"``), and an ``Image`` column (``datasets``' struct of the
encoded file's bytes and path, saved or in the Hub's Parquet files) its decoded pixels, uint8
[H, W] or [H, W, C]. A label of text becomes class ids (``FederatedDataset.label_names``).
Rows keep their order within a client. A saved ``DatasetDict`` brings its ``train`` and ``test``
splits; otherwise ``test=`` names a second table, or the test split is cut as ``load_leaf`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._dataset import FederatedDataset, TestSplit, with_test_split
from ._errors import DataLayoutError, DataSpecError, check_finite, require
from .partition import Partitioner, partition_arrays
from .text import WordIds

_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _read_arrow(path: Path, client: str | None, features: Sequence[str] | None = None) -> tuple[Any, Any | None]:
    """(train table, test table or None) as pyarrow Tables; of a Parquet file, only the client
    column and ``features`` are read when they are given (a file's other columns stay on disk)."""
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
            parquet = pq.ParquetFile(path)  # one file (read_table's dataset reader refuses a name twice)
            names = parquet.schema_arrow.names
            wanted = None  # every column, also when a feature is missing: group_by_client names it among them
            if features is not None and set(features) <= set(names):
                wanted = [c for c in names if c == client or c in features]
            return parquet.read(columns=wanted), None
        except Exception as exc:  # pyarrow's ArrowInvalid and OSError for a file that is not Parquet
            raise DataLayoutError(f"table: {path} is not a Parquet file ({exc})") from exc
    if suffix == ".csv":
        pa: Any = require("pyarrow")
        csv: Any = require("pyarrow.csv")
        try:  # client ids stay text: "007" is not 7
            types = {client: pa.string()} if client is not None else {}
            table = csv.read_csv(path, convert_options=csv.ConvertOptions(column_types=types))
            _ = table.column_names  # the header's names are decoded here, not when the file is read
        except UnicodeDecodeError as exc:
            raise DataLayoutError(
                f"table: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
            ) from None
        except Exception as exc:
            raise DataLayoutError(f"table: {path} could not be read as CSV ({exc})") from exc
        return table, None
    raise DataSpecError(f"table: {path} is neither .parquet, .csv nor a datasets folder; convert it to one of them")


def _is_list(kind: Any, pa: Any) -> bool:
    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def _is_image(kind: Any, pa: Any) -> bool:
    """``datasets``' ``Image`` feature as Arrow stores it (in a saved folder and in the Parquet files
    the Hub serves): a struct of the encoded file's ``bytes`` and its ``path``."""
    return bool(
        pa.types.is_struct(kind) and sorted(kind.field(i).name for i in range(kind.num_fields)) == ["bytes", "path"]
    )


def _images(array: Any, name: str, where: str) -> np.ndarray:
    """An ``Image`` column decoded to one array (uint8 [N, H, W] for greyscale, [N, H, W, C] for
    colour), as ``datasets``' numpy format decodes it; images of different sizes or modes are refused."""
    pil: Any = require("PIL.Image")
    import io

    blobs = array.field("bytes").to_pylist()
    paths = array.field("path").to_pylist()
    out = []
    for row, (blob, source) in enumerate(zip(blobs, paths)):
        if blob is None:
            raise DataLayoutError(
                f"table: {where}: column {name!r}, row {row}: the image is not in the table (only its path {source!r}); "
                "save the dataset with its images embedded (datasets' save_to_disk and to_parquet do)"
            )
        try:
            with pil.open(io.BytesIO(blob)) as image:
                out.append(np.asarray(image))
        except Exception as exc:  # PIL's UnidentifiedImageError, OSError for a truncated file
            raise DataLayoutError(
                f"table: {where}: column {name!r}, row {row} is not an image PIL reads ({exc})"
            ) from None
        if out[-1].shape != out[0].shape or out[-1].dtype != out[0].dtype:
            raise DataLayoutError(
                f"table: {where}: column {name!r} holds images of different sizes or modes ({out[0].dtype}"
                f"{list(out[0].shape)} in row 0, {out[-1].dtype}{list(out[-1].shape)} in row {row}); resize them to one"
            )
    return np.stack(out) if out else np.zeros((0,), dtype=np.uint8)


def _lists(array: Any, name: str, where: str, pa: Any) -> np.ndarray:
    """A column of equal-length lists, at any depth (a ``Sequence`` of ``Sequence``, an ``Array2D``),
    as one array [N, ...] read from Arrow's buffers: a column of 200,000 lists of 784 floats became
    157 million Python floats on the way (10 GB and 40 s), and its float32 became float64."""
    pc: Any = require("pyarrow.compute")
    shape = [len(array)]
    while _is_list(array.type, pa):
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise DataLayoutError(
                f"table: {where}: column {name!r} holds lists of different lengths; pad them to one length"
            )
        shape.append(int(lengths[0]) if len(lengths) else 0)
        array = array.flatten()
        if array.null_count:
            raise DataLayoutError(
                f"table: {where}: column {name!r} has {array.null_count} missing values inside its lists; fill them"
            )
    kind = array.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        values = np.asarray(array.to_pylist(), dtype=object)
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        values = array.to_numpy(zero_copy_only=False)
    else:
        raise DataLayoutError(
            f"table: {where}: column {name!r} holds lists of {kind}, not of numbers or strings; convert them"
        )
    return values.reshape(shape)


def _column(table: Any, name: str, where: str) -> np.ndarray:
    pa: Any = require("pyarrow")
    col = table.column(name)
    if col.null_count:
        raise DataLayoutError(
            f"table: {where}: column {name!r} has {col.null_count} missing values; fill or drop those rows"
        )
    array = col.combine_chunks()
    if isinstance(array.type, pa.ExtensionType):  # datasets' Array2D..Array5D: lists of lists underneath
        array = array.storage
    if pa.types.is_dictionary(array.type):  # a pandas category: its values, one per row
        array = array.dictionary_decode()
    if pa.types.is_temporal(array.type):  # a date or time (a CSV's ISO dates are read as such): text, as TFF's dates
        array = array.cast(pa.string())
    if pa.types.is_decimal(array.type):
        array = array.cast(pa.float64())
    kind = array.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return np.asarray(array.to_pylist(), dtype=object)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return check_finite(array.to_numpy(zero_copy_only=False), f"table: {where}: column {name!r}", "row")
    if _is_list(kind, pa):
        return check_finite(_lists(array, name, where, pa), f"table: {where}: column {name!r}", "row")
    if _is_image(kind, pa):
        return _images(array, name, where)
    raise DataLayoutError(
        f"table: {where}: column {name!r} has type {kind}, which is not a number, string, list or image; "
        "convert it to one of them before loading"
    )


def _stack(arrays: dict[str, np.ndarray], name: str, label: str | None, where: str) -> dict[str, np.ndarray]:
    """The numeric scalar columns but the label as one vector feature ``name`` [N, columns], in the
    table's column order (what a CSV of many numeric columns is to a model reading one vector)."""
    numeric = [n for n, a in arrays.items() if n != label and a.ndim == 1 and a.dtype.kind in "biuf"]
    if not numeric:
        raise DataSpecError(
            f"table: {where}: stack={name} finds no numeric column to stack besides the label {label!r}"
        )
    if name in arrays and name not in numeric:
        raise DataSpecError(
            f"table: {where}: stack={name} is the name of a column that is not stacked; name the stacked feature otherwise"
        )
    stacked = np.stack([arrays.pop(n) for n in numeric], axis=1)
    return {name: stacked, **arrays}


def _column_names(table: Any, where: str) -> list[str]:
    columns = list(table.column_names)
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if twice:
        raise DataLayoutError(
            f"table: {where} has the column {twice[0]!r} more than once; give each column its own name"
        )
    return columns


def _columns(
    table: Any,
    client: str | None,
    features: Sequence[str] | None,
    where: str,
    *,
    label: str | None,
    stack: str | None,
    order: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The feature columns (all but the client column, or ``features``) as arrays, rows in ``order``."""
    columns = _column_names(table, where)
    names = [c for c in columns if c != client] if features is None else list(features)
    missing = [n for n in names if n not in columns]
    if missing:
        raise DataSpecError(f"table: {where} has no column {missing[0]!r}; its columns are {', '.join(columns)}")
    if not names:
        raise DataLayoutError(f"table: {where} has no feature column besides the client column {client!r}")
    arrays = {n: _column(table, n, where) for n in names}
    if order is not None:
        arrays = {n: a[order] for n, a in arrays.items()}  # one copy in client order; clients are views of it
    return _stack(arrays, stack, label, where) if stack is not None else arrays


def group_by_client(
    table: Any,
    client: str,
    features: Sequence[str] | None,
    where: str,
    *,
    label: str | None = None,
    stack: str | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """Rows grouped by the client column, keeping their order within each client; with ``stack``,
    the numeric scalar columns but ``label`` become one vector feature of that name."""
    columns = _column_names(table, where)
    if client not in columns:
        raise DataSpecError(f"table: {where} has no client column {client!r}; its columns are {', '.join(columns)}")
    if table.column(client).null_count:
        raise DataLayoutError(f"table: {where}: client column {client!r} has missing values; every row needs a client")
    ids = np.asarray([str(v) for v in table.column(client).to_pylist()], dtype=object)
    if (ids == "").any():  # a CSV's empty cell: text, not null, but no client's id either
        raise DataLayoutError(
            f"table: {where}: client column {client!r} has {int((ids == '').sum())} empty ids; every row needs a client"
        )
    order = np.argsort(ids.astype(str), kind="stable")
    arrays = _columns(table, client, features, where, label=label, stack=stack, order=order)
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]) if len(ids) else np.zeros(0, dtype=np.int64)
    bounds = np.r_[starts, len(ids)]
    return {str(sorted_ids[s]): {n: a[s:e] for n, a in arrays.items()} for s, e in zip(bounds[:-1], bounds[1:])}


def load_table(
    path: str | Path,
    *,
    client: str | None,
    test: str | Path | None = None,
    label: str | None = None,
    features: Sequence[str] | None = None,
    stack: str | None = None,
    words: WordIds | None = None,
    partition: Partitioner | None = None,
    test_split: TestSplit = "examples",
    test_fraction: float = 0.1,
    seed: int = 0,
) -> FederatedDataset:
    """A table of examples with a client column (``client``) as a federated dataset, or a table of
    one centralized dataset (``client`` None) cut into clients by ``partition`` (flwr-datasets'
    way with a Hugging Face dataset); ``stack=NAME`` makes its numeric scalar columns (of
    ``features``, if given) but the label one vector feature, and ``words`` text columns word ids,
    as ``load_tff_h5`` reads them."""
    path = Path(path)
    if client is None and partition is None:
        raise DataSpecError(
            f"table: name the client-id column (table:{path},client=COLUMN), or cut the rows into clients "
            "(partition=iid|dirichlet|shards|pathological|quantity)"
        )
    train_table, test_table = _read_arrow(path, client, features)
    if label is None:
        kept = list(features) if features is not None else list(train_table.column_names)
        label = next((n for n in ("label", "y") if n in kept and n != client), None)
    if test is not None:
        test_table, _ = _read_arrow(Path(test), client, features)
    test_where = str(test or path)
    if client is None:
        assert partition is not None
        if label is None:
            raise DataSpecError(
                f"table: {path} has no column 'label' or 'y'; name the label to partition by, label=COLUMN"
            )
        arrays = _columns(train_table, None, features, str(path), label=label, stack=stack)
        held = _columns(test_table, None, features, test_where, label=label, stack=stack) if test_table else None
        vocabulary = words.encode({"": arrays}, {"": held} if held else {}, "table: ") if words is not None else ()
        return partition_arrays(
            arrays,
            partition,
            label=label,
            seed=seed,
            test_split=test_split,
            test_fraction=test_fraction,
            test=held,
            source=f"table:{path}",
            vocabulary=vocabulary,
        )
    train = group_by_client(train_table, client, features, str(path), label=label, stack=stack)
    test_clients = (
        group_by_client(test_table, client, features, test_where, label=label, stack=stack)
        if test_table is not None
        else None
    )
    if not train:
        raise DataLayoutError(f"table: {path} has no rows")
    if test_split not in ("examples", "clients"):
        raise DataSpecError(f"table: test_split={test_split} is for partitioned data; use examples or clients")
    vocabulary = words.encode(train, test_clients or {}, "table: ") if words is not None else ()
    return with_test_split(
        train,
        test=test_clients,
        how="clients" if test_split == "clients" else "examples",
        fraction=test_fraction,
        seed=seed,
        label=label,
        source=f"table:{path}",
        vocabulary=vocabulary,
    )
