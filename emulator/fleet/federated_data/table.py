"""A table with a client-id column: Parquet, CSV (its delimiter found from the header line), JSON
Lines or Arrow IPC, a file or a folder of them (as ``write_to_dataset`` and Spark write Parquet,
hive's ``key=value`` folders included, or a file a client), or a Hugging Face ``datasets`` dataset
saved with ``save_to_disk`` (or a folder of them, a client each, as flwr-datasets' partitions are
saved) or in its cache (what ``load_dataset`` leaves), read with pyarrow (and ``datasets`` for the
saved folders).

Each row is one example; the client column says whose it is (flwr-datasets' ``NaturalIdPartitioner``
does the same with a column); every other column is a feature (``features=a+b`` keeps some, and
``stack=x`` makes the numeric ones but the label one vector feature ``x``, for a CSV of many). A
column of numbers is a scalar feature, a column of equal-length lists (Parquet list columns, a
``datasets`` ``Sequence``, ``Array2D``) a vector or tensor, read from Arrow's buffers, a column of
strings a text feature (dtype ``"str"``), and an ``Image`` column (``datasets``' struct of the
encoded file's bytes and path, saved or in the Hub's Parquet files) its decoded pixels, uint8
[H, W] or [H, W, C]. A label of text becomes class ids (``FederatedDataset.label_names``).
Rows keep their order within a client. A saved ``DatasetDict`` brings its ``train`` and ``test``
(or ``validation``) splits; otherwise ``test=`` names a second table, or the test split is cut as
``load_leaf`` does. What would be read as something it is not is refused: a missing value, a
``ClassLabel``'s -1, an ``Audio`` column, lists of different lengths, a CSV column without a name;
a pandas index without a name (``__index_level_0__``) is left out.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._dataset import FederatedDataset, TestSplit, check_fraction, example_split, named_labels, with_test_split
from ._errors import DataLayoutError, DataSpecError, check_finite, check_link, check_readable, require
from .partition import Partitioner, partition_arrays
from .text import LEAF_CHARACTERS, WordIds, encode_characters

_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
#: A table's own file suffixes (a compressed CSV too, which pyarrow decompresses by its suffix).
_PARQUET = (".parquet", ".pq")
_CSV = (".csv", ".tsv", ".txt")
_JSON_LINES = (".jsonl", ".ndjson")
#: Arrow's IPC files: datasets' cache (what load_dataset, and so flwr-datasets, leave on disk) and
#: save_to_disk's shards are streams; Feather v2 is the file format.
_ARROW = (".arrow", ".feather")
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
#: The delimiters a CSV's header line is looked at for (a spreadsheet's semicolons, a TSV's tabs).
_DELIMITERS = (",", ";", "\t", "|")
#: The test splits a saved ``DatasetDict`` may bring, in the order one is taken.
_TEST_SPLITS = ("test", "validation")


def _suffix(path: Path) -> str:
    """The table suffix of ``path``, past a compression suffix (``data.csv.gz``: ``.csv``)."""
    suffixes = [s.lower() for s in path.suffixes]
    if len(suffixes) > 1 and suffixes[-1] in _COMPRESSED:
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


def _read_arrow(
    path: Path, client: str | None, features: Sequence[str] | None = None, *, header: bool = True
) -> tuple[Any, Any | None]:
    """(train table, test table or None) as pyarrow Tables; of Parquet, only the client column and
    ``features`` are read when they are given (a file's other columns stay on disk)."""
    if not path.exists():
        raise DataSpecError(f"table: {path} does not exist")
    check_readable(path, "table: ")
    if path.is_dir():
        if _is_cache(path):
            return _read_cache(path, client, features)
        if _is_saved(path):
            return _read_saved(path)
        saved = sorted(p for p in path.iterdir() if p.is_dir() and _is_saved(p))
        if saved:
            return _read_saved_folders(path, saved, client)
        caches = sorted(p.parent for p in path.rglob("dataset_info.json") if _is_cache(p.parent))
        if len(caches) == 1:  # the cache's root (~/.cache/huggingface/datasets/owner___name): its one version
            return _read_cache(caches[0], client, features)
        if caches:  # read as one folder of .arrow files, every version's splits and map caches were one table
            raise DataLayoutError(
                f"table: {path} holds {len(caches)} datasets cache folders ({caches[0].relative_to(path)}, "
                f"{caches[1].relative_to(path)}, ...); give the one to read"
            )
        return _read_folder(path, client, features, header=header), None
    if _kind(path) is None:
        raise DataSpecError(
            f"table: {path} is neither .parquet, .csv (.tsv), .jsonl (any of them gzipped), .arrow nor a folder of "
            "such files, from datasets' save_to_disk or its cache; convert it to one of them"
        )
    return _read_file(path, client, features, header=header), None


def _kind(path: Path) -> str | None:
    """The table format of a file by its suffix: parquet, csv, jsonl, arrow, or None."""
    suffix = _suffix(path)
    for kind, suffixes in (("parquet", _PARQUET), ("csv", _CSV), ("jsonl", _JSON_LINES), ("arrow", _ARROW)):
        if suffix in suffixes:
            return kind
    return None


def _read_file(path: Path, client: str | None, features: Sequence[str] | None, *, header: bool) -> Any:
    """One table file as a pyarrow Table (of Parquet, only the columns ``_wanted`` names)."""
    check_readable(path, "table: ")
    kind = _kind(path)
    if kind == "parquet":
        pq: Any = require("pyarrow.parquet")
        try:
            parquet = pq.ParquetFile(path)  # one file (read_table's dataset reader refuses a name twice)
            return parquet.read(columns=_wanted(parquet.schema_arrow.names, client, features))
        except Exception as exc:  # pyarrow's ArrowInvalid and OSError for a file that is not Parquet
            raise DataLayoutError(f"table: {path} is not a Parquet file ({exc})") from exc
    if kind == "csv":
        return _read_csv(path, client, header=header)
    if kind == "arrow":
        table = _read_ipc(path)
        wanted = _wanted(table.column_names, client, features)
        return table.select(wanted) if wanted is not None else table
    json: Any = require("pyarrow.json")
    try:  # one object a line, as datasets' to_json and pandas' to_json(lines=True) write them
        return json.read_json(path)
    except Exception as exc:  # ArrowInvalid: not JSON, or a field that is a number here and text there
        raise DataLayoutError(f"table: {path} could not be read as JSON Lines ({exc})") from exc


def _read_ipc(path: Path) -> Any:
    """An Arrow IPC file, memory-mapped: a stream (as ``datasets`` writes its cache and its saved
    shards) or the file format (Feather v2)."""
    pa: Any = require("pyarrow")
    try:
        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all()
    except Exception as exc:  # ArrowInvalid for a file that is neither
        raise DataLayoutError(f"table: {path} is not an Arrow IPC file ({exc})") from exc


def _is_cache(path: Path) -> bool:
    """A folder of ``datasets``' cache (``load_dataset``'s, flwr-datasets' download): its
    ``dataset_info.json`` and ``<name>-<split>.arrow`` files, without ``save_to_disk``'s state."""
    return (
        (path / "dataset_info.json").is_file()
        and not any((path / m).is_file() for m in ("state.json", "dataset_dict.json"))
        and any(path.glob("*.arrow"))
    )


def _read_cache(path: Path, client: str | None, features: Sequence[str] | None) -> tuple[Any, Any | None]:
    """A ``datasets`` cache folder's ``train`` split and its ``test`` (or ``validation``): the files
    ``<name>-<split>.arrow`` or ``<name>-<split>-00000-of-00002.arrow`` (``cache-*.arrow``, what a
    ``map`` wrote, is no split's)."""
    pa: Any = require("pyarrow")
    by_split: dict[str, list[Path]] = {}
    for file in sorted(path.glob("*.arrow")):
        found = re.fullmatch(r".+?-([^-]+)(?:-\d+-of-\d+)?\.arrow", file.name)
        if found and not file.name.startswith("cache-"):
            by_split.setdefault(found.group(1), []).append(file)
    if "train" not in by_split:
        raise DataLayoutError(
            f"table: {path} is a datasets cache folder whose splits are {sorted(by_split) or 'none'}, with no "
            "'train'; give the .arrow file of the split to train on"
        )
    held = next((s for s in _TEST_SPLITS if s in by_split), None)
    train, test = (
        pa.concat_tables([_read_file(f, client, features, header=True) for f in by_split[split]])
        if split is not None
        else None
        for split in ("train", held)
    )
    return train, test


def _wanted(names: Sequence[str], client: str | None, features: Sequence[str] | None) -> list[str] | None:
    """The columns to read: the client column and ``features``, or every column (None) when a
    feature is missing, so that ``_columns`` names it among them."""
    if features is None:
        return None
    try:
        kept = set(_expand(features, names, ""))
    except DataSpecError:
        return None
    return [c for c in names if c == client or c in kept]


def _is_saved(path: Path) -> bool:
    return any((path / m).is_file() for m in _HF_MARKERS)


def _read_saved_folders(path: Path, folders: Sequence[Path], client: str | None) -> tuple[Any, Any | None]:
    """A folder of ``save_to_disk`` folders, one a client (flwr-datasets' partitions saved one by
    one, each a ``Dataset`` or the ``DatasetDict`` of its ``train_test_split``): their rows as one
    table, a client's rows given the column ``client`` holding its folder's name unless they have it."""
    pa: Any = require("pyarrow")
    splits: tuple[list[Any], list[Any]] = ([], [])
    for folder in folders:
        for rows, table in zip(splits, _read_saved(folder)):
            if table is None:
                continue
            if client is not None and client not in table.column_names:
                table = table.append_column(client, pa.array([folder.name] * table.num_rows, pa.string()))
            first = (rows[0] if rows else table).schema.remove_metadata()
            if not table.schema.remove_metadata().equals(first):
                raise DataLayoutError(
                    f"table: {path}: {folder.name} has the columns {_schema(table.schema)} but {folders[0].name} has "
                    f"{_schema(first)}; save every partition with one schema"
                )
            rows.append(table.replace_schema_metadata((rows[0] if rows else table).schema.metadata))
    train, test = (pa.concat_tables(rows) if rows else None for rows in splits)
    return train, test


def _read_saved(path: Path) -> tuple[Any, Any | None]:
    """A folder from ``datasets``' ``save_to_disk``: a ``Dataset``, or a ``DatasetDict``'s ``train``
    and its ``test`` (or, without one, ``validation``) split."""
    datasets: Any = require("datasets")
    for file in sorted(path.rglob("*")):  # datasets says a file it may not read is not a saved folder
        check_readable(file, "table: ")
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a damaged folder
        raise DataLayoutError(f"table: {path} could not be read as a saved datasets folder ({exc})") from exc
    if isinstance(saved, datasets.DatasetDict):
        if "train" not in saved:
            raise DataLayoutError(
                f"table: {path} holds splits {sorted(saved)} but no 'train' split; save the training rows as 'train'"
            )
        held = next((saved[s] for s in _TEST_SPLITS if s in saved), None)
        return saved["train"].with_format("arrow")[:], (held.with_format("arrow")[:] if held is not None else None)
    return saved.with_format("arrow")[:], None


def _read_folder(path: Path, client: str | None, features: Sequence[str] | None, *, header: bool) -> Any:
    """A folder of table files of one format as one table: Parquet as ``write_to_dataset`` and Spark
    write it, CSV or JSON Lines files, read file by file (pyarrow's dataset scanner took 12 s over
    10,000 one-client files that take 3 s so), in subfolders too, in the order of their paths. A hive
    partition's ``key=value`` folder names are columns, as text (``client_id=007`` is client
    ``007``) but for keys whose every value is a number; when no file has the client column, each
    file's name (``client_7.csv``: ``client_7``) is its rows' client. Files whose names start with
    ``_`` or ``.`` (``_metadata``, ``_SUCCESS``) and files of no table format are left out."""
    from urllib.parse import unquote

    listed = [p for p in path.rglob("*") if not any(part.startswith(("_", ".")) for part in p.relative_to(path).parts)]
    for p in listed:
        if _kind(p) is not None:
            check_link(p, "table: ")
    files = sorted(p for p in listed if p.is_file())
    kinds = sorted({k for k in map(_kind, files) if k is not None})
    if len(kinds) != 1:
        found = ", ".join(sorted({p.suffix or p.name for p in files})[:5]) or "no files"
        raise DataLayoutError(
            f"table: {path} is a folder of {'files of several formats' if kinds else 'no table files'} (found "
            f"{found}), and not from datasets' save_to_disk ({', '.join(_HF_MARKERS)}); give a file, or a folder "
            "of .parquet, .csv or .jsonl files, or a folder written by save_to_disk"
        )
    pa: Any = require("pyarrow")
    tables, named = [], []
    by_name: dict[str, Path] = {}  # the files named as clients, by the client their name gives
    tabular = [p for p in files if _kind(p) == kinds[0]]
    keys: list[str] | None = None
    for file in tabular:
        folders = [seg.split("=", 1) for seg in file.relative_to(path).parts[:-1] if "=" in seg]
        partition = {unquote(k): unquote(v) for k, v in folders}
        if keys is None:
            keys = list(partition)
        elif list(partition) != keys:
            raise DataLayoutError(
                f"table: {path}: {file.relative_to(path)} is in partition folders {list(partition)} but "
                f"{tabular[0].relative_to(path)} in {keys}; give every file the same key=value folders"
            )
        table = _read_file(file, client, features, header=header)
        names = table.column_names
        wanted = _wanted([*names, *keys], client, features)
        for key, value in partition.items():
            if key in names:
                raise DataLayoutError(
                    f"table: {file}: column {key!r} is both in the file and in its folder name {key}={value}"
                )
            if wanted is None or key in wanted:
                held = None if value == "__HIVE_DEFAULT_PARTITION__" else value  # Hive's and Spark's null
                table = table.append_column(key, pa.array([held] * table.num_rows, pa.string()))
        if client is not None and client not in table.column_names:  # the file's name says whose rows they are
            stem = file.with_suffix("").stem if file.suffix.lower() in _COMPRESSED else file.stem
            same = by_name.setdefault(stem, file)
            if same is not file:  # write_to_dataset names every folder's file alike: all rows one client
                raise DataLayoutError(
                    f"table: {path} has no column {client!r} (its columns: {', '.join(table.column_names)}), and "
                    f"its files' names cannot stand for clients: {same.relative_to(path)} and "
                    f"{file.relative_to(path)} are both named {stem}; name the client column with client=COLUMN"
                )
            named.append(file)
            table = table.append_column(client, pa.array([stem] * table.num_rows, pa.string()))
        tables.append(table)
    if named and len(named) != len(tabular):
        have = next(p for p in tabular if p not in named)
        raise DataLayoutError(
            f"table: {path}: {have.relative_to(path)} has the client column {client!r} but "
            f"{named[0].relative_to(path)} has not; give it to every file, or to none (each file's name is then "
            "its rows' client)"
        )
    first = tables[0].schema.remove_metadata()
    for file, table in zip(tabular, tables):
        if not table.schema.remove_metadata().equals(first):
            raise DataLayoutError(
                f"table: {path}: {file.relative_to(path)} has the columns {_schema(table.schema)} but "
                f"{tabular[0].relative_to(path)} has {_schema(first)}; write every file with one schema"
            )
    table = pa.concat_tables(tables)
    for key in keys or ():
        if key != client and key in table.column_names:
            table = table.set_column(table.column_names.index(key), key, _typed(table.column(key), pa))
    return table


def _schema(schema: Any) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def _typed(column: Any, pa: Any) -> Any:
    """A hive partition key's text values as int64 or float64 when every one is such a number."""
    for kind in (pa.int64(), pa.float64()):
        try:
            return column.cast(kind)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    return column


def _first_line(path: Path) -> str:
    """A CSV's first line as text (a byte-order mark and a Windows line end left out), or "" when
    the file cannot be read (pyarrow then says what is wrong with it)."""
    pa: Any = require("pyarrow")
    try:
        with pa.input_stream(str(path), compression="detect") as stream:
            head = stream.read(1 << 16)
    except Exception:
        return ""
    return head.split(b"\n", 1)[0].decode("utf-8", "replace").removeprefix("\ufeff").removesuffix("\r")


def _delimiter(path: Path, line: str) -> str:
    """The delimiter of a CSV's header line: the most frequent of ``_DELIMITERS`` outside quotes
    (a tab for .tsv), so that a spreadsheet's semicolon-separated export reads as its columns."""
    if _suffix(path) == ".tsv":
        return "\t"
    unquoted = "".join(line.split('"')[::2])
    counts = {d: unquoted.count(d) for d in _DELIMITERS}
    best = max(_DELIMITERS, key=lambda d: counts[d])  # the first of the most frequent: "," on ties
    return best if counts[best] else ","


def _read_csv(path: Path, client: str | None, *, header: bool) -> Any:
    """A CSV (or TSV) file: its delimiter found from the header line, a byte-order mark and Windows
    line ends taken as pyarrow takes them, the spaces around the header's names left out (``user,
    x, label``) and then around its text values too, client ids kept as text ("007" is not 7);
    without a header line (``header=False``) the columns are named f0, f1, ... A semicolon-separated
    file's numbers written with a decimal comma (``2,5``, a European spreadsheet's) are numbers."""
    import csv as text_csv

    pa: Any = require("pyarrow")
    csv: Any = require("pyarrow.csv")
    line = _first_line(path)
    delimiter = _delimiter(path, line)
    read = csv.ReadOptions(autogenerate_column_names=not header)
    names = next(text_csv.reader([line], delimiter=delimiter), []) if header else []
    spaced = any(n != n.strip() for n in names)  # "user, x, label": a space after each delimiter
    if spaced:
        read = csv.ReadOptions(column_names=[n.strip() for n in names], skip_rows=1)
    try:
        types = {client: pa.string()} if client is not None else {}
        table = csv.read_csv(
            path,
            read_options=read,
            parse_options=csv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
            convert_options=csv.ConvertOptions(column_types=types),
        )
        _ = table.column_names  # the header's names are decoded here, not when the file is read
    except UnicodeDecodeError as exc:
        raise DataLayoutError(
            f"table: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    except Exception as exc:
        raise DataLayoutError(f"table: {path} could not be read as CSV ({exc})") from exc
    empty = {i for i, (n, c) in enumerate(zip(table.column_names, table.columns)) if not n and c.null_count == len(c)}
    if empty:  # a spreadsheet's rows ending in delimiters ("a,b,c,"): columns of no name and no value
        table = table.select([i for i in range(table.num_columns) if i not in empty])
    if spaced:  # its text values have the space too: " cat" and "cat" would be two classes
        pc: Any = require("pyarrow.compute")
        for i, column in enumerate(table.columns):
            if pa.types.is_string(column.type):
                table = table.set_column(i, table.column_names[i], pc.utf8_trim_whitespace(column))
    if delimiter == ";":
        table = _decimal_commas(table, client)
    return table


_DECIMAL_COMMA = r"^[+-]?[0-9]+(,[0-9]+)?$"


def _decimal_commas(table: Any, client: str | None) -> Any:
    """Text columns whose every value is a number with a decimal comma as float64 columns."""
    pa: Any = require("pyarrow")
    pc: Any = require("pyarrow.compute")
    for i, name in enumerate(table.column_names):
        column = table.column(i)
        if name == client or not pa.types.is_string(column.type) or not len(column) - column.null_count:
            continue
        if (
            pc.all(pc.match_substring_regex(column, _DECIMAL_COMMA)).as_py()
            and pc.any(pc.match_substring(column, ",")).as_py()
        ):
            numbers = pc.cast(pc.replace_substring(column, ",", "."), pa.float64())
            table = table.set_column(i, name, numbers)
    return table


def _is_list(kind: Any, pa: Any) -> bool:
    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def _is_image(kind: Any, pa: Any) -> bool:
    """``datasets``' ``Image`` feature as Arrow stores it (in a saved folder and in the Parquet files
    the Hub serves): a struct of the encoded file's ``bytes`` and its ``path``."""
    return bool(
        pa.types.is_struct(kind) and sorted(kind.field(i).name for i in range(kind.num_fields)) == ["bytes", "path"]
    )


_IMAGE_BATCH = 4096  # rows whose encoded files are Python bytes at once


def _images(column: Any, name: str, where: str) -> np.ndarray:
    """An ``Image`` column decoded to one array (uint8 [N, H, W] for greyscale, [N, H, W, C] for
    colour), as ``datasets``' numpy format decodes it; images of different sizes or modes are refused.
    Each image is decoded into its row of the array, made at the first: 100,000 FEMNIST-sized images
    held their files as Python bytes, an array and its buffer each, and then a stacked copy (719 MB
    at the peak for 78 MB of pixels)."""
    pil: Any = require("PIL.Image")
    import io

    out: np.ndarray | None = None
    row = 0
    for chunk in getattr(column, "chunks", [column]):
        blobs_column, paths_column = (chunk.flatten()[chunk.type.get_field_index(f)] for f in ("bytes", "path"))
        for start in range(0, len(chunk), _IMAGE_BATCH):
            blobs = blobs_column.slice(start, _IMAGE_BATCH).to_pylist()
            paths = paths_column.slice(start, _IMAGE_BATCH).to_pylist()
            for blob, source in zip(blobs, paths):
                if blob is None:
                    raise DataLayoutError(
                        f"table: {where}: column {name!r}, row {row}: the image is not in the table (only its path "
                        f"{source!r}); datasets' save_to_disk embeds the files, to_parquet keeps their paths: save "
                        "the dataset with save_to_disk, or embed them first (dataset.with_format('arrow')"
                        ".map(datasets.table.embed_table_storage, batched=True))"
                    )
                try:
                    with pil.open(io.BytesIO(blob)) as image:
                        pixels = np.asarray(image)
                except Exception as exc:  # PIL's UnidentifiedImageError, OSError for a truncated file
                    raise DataLayoutError(
                        f"table: {where}: column {name!r}, row {row} is not an image PIL reads ({exc})"
                    ) from None
                if out is None:
                    out = np.empty((len(column), *pixels.shape), dtype=pixels.dtype)
                elif pixels.shape != out.shape[1:] or pixels.dtype != out.dtype:
                    raise DataLayoutError(
                        f"table: {where}: column {name!r} holds images of different sizes or modes ({out.dtype}"
                        f"{list(out.shape[1:])} in row 0, {pixels.dtype}{list(pixels.shape)} in row {row}); "
                        "resize them to one"
                    )
                out[row] = pixels
                row += 1
    return out if out is not None else np.zeros((0,), dtype=np.uint8)


def _lists(array: Any, name: str, where: str, pa: Any) -> np.ndarray:
    """A column of equal-length lists, at any depth (a ``Sequence`` of ``Sequence``, an ``Array2D``),
    as one array [N, ...] read from Arrow's buffers: a column of 200,000 lists of 784 floats became
    157 million Python floats on the way (10 GB and 40 s), and its float32 became float64."""
    pc: Any = require("pyarrow.compute")
    shape = [len(array)]
    while _is_list(array.type, pa):
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            row = int(np.flatnonzero(lengths != lengths[0])[0])
            raise DataLayoutError(
                f"table: {where}: column {name!r} holds lists of different lengths ({int(lengths.min())} to "
                f"{int(lengths.max())}: {int(lengths[0])} in row 0, {int(lengths[row])} in row {row}); pad or cut them "
                f"to one length with pad={name}:LENGTH:VALUE (or a tokenizer's padding='max_length', truncation=True), "
                "or leave the column out with features="
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


def pad_lists(table: Any, pads: Mapping[str, tuple[int, float]], where: str) -> Any:
    """``table`` with the list columns ``pads`` names (name -> length and value) padded with the
    value or cut to the length (``pad=input_ids:128:0``: a tokenizer's ``input_ids`` without
    padding), as equal-length lists of their own dtype."""
    pa: Any = require("pyarrow")
    pc: Any = require("pyarrow.compute")
    for name, (length, value) in pads.items():
        if name not in table.column_names:
            raise DataSpecError(
                f"table: {where}: pad={name}: no such column; its columns are {', '.join(table.column_names)}"
            )
        column = table.column(name).combine_chunks()
        if isinstance(column.type, pa.ExtensionType):
            column = column.storage
        if not _is_list(column.type, pa):
            raise DataSpecError(f"table: {where}: pad={name}: column {name!r} has type {column.type}, not lists")
        if column.null_count:
            raise DataLayoutError(
                f"table: {where}: column {name!r} has {column.null_count} missing values; fill or drop those rows"
            )
        flat = column.flatten()
        if _is_list(flat.type, pa) or not (pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type)):
            raise DataSpecError(
                f"table: {where}: pad={name}: column {name!r} holds lists of {flat.type}; pad= pads lists of numbers"
            )
        if flat.null_count:
            raise DataLayoutError(
                f"table: {where}: column {name!r} has {flat.null_count} missing values inside its lists; fill them"
            )
        values = flat.to_numpy(zero_copy_only=False)
        if np.asarray(value).astype(values.dtype) != value:
            raise DataSpecError(f"table: {where}: pad={name}: the value {value:g} is not a {values.dtype}")
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        starts = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
        out = np.full((len(lengths), length), value, dtype=values.dtype)
        kept = np.arange(length) < np.minimum(lengths, length)[:, None]
        out[kept] = values[(starts[:, None] + np.arange(length))[kept]]
        padded = pa.FixedSizeListArray.from_arrays(pa.array(out.ravel()), length)
        table = table.set_column(table.column_names.index(name), name, padded)
    return table


#: ``datasets`` features stored as encoded files that this loader does not decode.
_UNDECODED = ("Audio", "Video", "Pdf", "Nifti")


def _hf_features(table: Any) -> dict[str, Any]:
    """Column name -> ``datasets``' description of its feature (``{"_type": "ClassLabel", "names":
    [...]}``), from the schema metadata ``datasets`` writes in a saved folder and in Parquet files."""
    import json

    metadata = table.schema.metadata or {}
    try:
        features = json.loads(metadata.get(b"huggingface", b"{}")).get("info", {}).get("features", {})
    except (ValueError, AttributeError):  # metadata written by something else
        return {}
    return features if isinstance(features, dict) else {}


def _column(table: Any, name: str, where: str, feature: Any = None) -> np.ndarray:
    """One column as an array (see the module docstring); ``feature``: its ``datasets`` feature
    description, if the table has one."""
    pa: Any = require("pyarrow")
    col = table.column(name)
    kind = feature.get("_type") if isinstance(feature, dict) else None
    if kind in _UNDECODED:
        raise DataLayoutError(
            f"table: {where}: column {name!r} is datasets' {kind} feature (encoded files), which is not decoded "
            f"here; map it to a column of equal-length number lists (e.g. {kind.lower()}['array'] cut to one length) "
            "and save that, or leave it out with features="
        )
    if kind == "ClassLabel" and col.null_count == 0 and pa.types.is_integer(col.type):
        missing = int(pa.compute.sum(pa.compute.less(col, 0)).as_py() or 0)
        if missing:
            raise DataLayoutError(
                f"table: {where}: column {name!r} (a ClassLabel) has {missing} rows labelled -1, datasets' "
                f"missing label; drop them (dataset.filter(lambda row: row[{name!r}] >= 0)) or label them"
            )
    if col.null_count:
        raise DataLayoutError(
            f"table: {where}: column {name!r} has {col.null_count} missing values; fill or drop those rows, "
            "or leave the column out with features="
        )
    if _is_image(col.type, pa):  # decoded chunk by chunk: a combined copy of the files is not needed
        return _images(col, name, where)
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
    raise DataLayoutError(
        f"table: {where}: column {name!r} has type {kind}, which is not a number, string, list or image; "
        "convert it to one of them before loading"
    )


def _check_named(labels: np.ndarray, name: str, where: str) -> None:
    """A text label whose every value names a class: an empty one is a missing label (a CSV's empty
    cell, which pyarrow reads as empty text), not a class named ""."""
    empty = int((labels == "").sum())
    if empty:
        row = int(np.flatnonzero(labels == "")[0])
        raise DataLayoutError(
            f"table: {where}: label column {name!r} is empty in {empty} rows (the first: row {row}), a missing "
            "label, not a class; label or drop those rows"
        )


def _character_ids(texts: np.ndarray, name: str, where: str) -> np.ndarray:
    """A text column of one length as ids in ``LEAF_CHARACTERS`` (others: 80): uint8 [N, length], or
    [N] for single characters (a next-character label)."""
    if texts.dtype != object:
        raise DataSpecError(f"table: characters={name}: column {name!r} is {texts.dtype}, not text")
    lengths = np.fromiter((len(t) for t in texts), np.int64, len(texts))
    if len(lengths) and lengths.min() != lengths.max():
        row = int(np.flatnonzero(lengths != lengths[0])[0])
        raise DataLayoutError(
            f"table: {where}: characters={name}: column {name!r} holds texts of {lengths[0]} characters (row 0) "
            f"and {lengths[row]} (row {row}); every text needs one length (LEAF's Shakespeare: 80, and 1 for y)"
        )
    length = int(lengths[0]) if len(lengths) else 1
    ids = encode_characters("".join(texts)).reshape(len(texts), length)
    return ids[:, 0] if length == 1 else ids


def _number_dtype(kind: Any, pa: Any) -> np.dtype | None:
    """The numpy dtype ``_column`` reads a column of Arrow type ``kind`` as, when it is a scalar
    number (a decimal: float64; a category: its values'); None otherwise."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_decimal(kind):
        return np.dtype(np.float64)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return np.dtype(kind.to_pandas_dtype())
    return None


def _stacked(table: Any, names: Sequence[str], name: str, label: str | None, where: str) -> dict[str, np.dtype]:
    """The columns ``stack=name`` makes one vector feature: the numeric scalar ones but the label,
    in the table's column order (a CSV of many numeric columns, to a model reading one vector)."""
    pa: Any = require("pyarrow")
    numeric = {}
    for n in names:
        dtype = _number_dtype(table.schema.field(n).type, pa) if n != label else None
        if dtype is not None:
            numeric[n] = dtype
    if not numeric:
        raise DataSpecError(
            f"table: {where}: stack={name} finds no numeric column to stack besides the label {label!r}"
        )
    if name in names and name not in numeric:
        raise DataSpecError(
            f"table: {where}: stack={name} is the name of a column that is not stacked; name the stacked feature otherwise"
        )
    return numeric


def _header_hint(columns: Sequence[str]) -> str:
    """What to say when a table's column names are all numbers: a CSV whose first line is data."""
    numbers = 0
    for name in columns:
        try:
            float(name)
        except ValueError:
            continue
        numbers += 1
    if numbers * 2 < len(columns) or not columns:
        return ""
    return " (its first line looks like data: give header=no for a CSV without a header line, columns f0, f1, ...)"


def _column_names(table: Any, where: str) -> list[str]:
    columns = list(table.column_names)
    twice = sorted({c for c in columns if columns.count(c) > 1})
    if twice:
        raise DataLayoutError(
            f"table: {where} has the column {twice[0]!r} more than once; give each column its own name"
            + _header_hint(columns)
        )
    return columns


#: The column pandas' ``to_parquet`` (and ``datasets``' ``from_pandas``) writes for an index without
#: a name, as a filtered DataFrame has: not a feature.
_PANDAS_INDEX = re.compile(r"__index_level_[0-9]+__")


def _expand(features: Sequence[str], columns: Sequence[str], where: str) -> list[str]:
    """``features``' names, a pattern among them (``pixel*``, as ``fnmatch`` reads it) standing for
    the columns it matches in the table's order: MNIST's CSV names its 784 pixel columns so."""
    out: list[str] = []
    for pattern in features:
        found = (
            [c for c in columns if fnmatch.fnmatchcase(c, pattern)]
            if any(ch in pattern for ch in "*?[")
            else ([pattern] if pattern in columns else [])
        )
        if not found:
            shown = ", ".join(columns[:12]) + (f", ... ({len(columns)} columns)" if len(columns) > 12 else "")
            raise DataSpecError(
                f"table: {where} has no column {'matching ' if pattern not in columns else ''}{pattern!r}; "
                f"its columns are {shown}"
            )
        out += [c for c in found if c not in out]
    return out


def _columns(
    table: Any,
    client: str | None,
    features: Sequence[str] | None,
    where: str,
    *,
    label: str | None,
    stack: str | None,
    order: np.ndarray | None = None,
    characters: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """The feature columns (all but the client column and a pandas index, or ``features``) as
    arrays, rows in ``order``; those ``characters`` names as ids in LEAF's characters."""
    columns = _column_names(table, where)
    if features is None:
        names = [c for c in columns if c != client and not _PANDAS_INDEX.fullmatch(c)]
        if "" in names:
            raise DataLayoutError(
                f"table: {where}: column {columns.index('') + 1} has no name (pandas' to_csv writes its index so); "
                "write the file with index=False, name the column, or pick the features with features="
            )
    else:
        names = _expand(features, columns, where)
    if not names:
        raise DataLayoutError(f"table: {where} has no feature column besides the client column {client!r}")
    for name in characters:
        if name not in names:
            raise DataSpecError(
                f"table: characters={name}: {where} has no feature column {name!r}; its features are {', '.join(names)}"
            )
    described = _hf_features(table)
    numeric = _stacked(table, names, stack, label, where) if stack is not None else {}
    arrays: dict[str, np.ndarray] = {}
    matrix = np.empty((table.num_rows, len(numeric)), np.result_type(*numeric.values())) if numeric else None
    for n in names:  # one column at a time in client order, a stacked one into its place in the matrix
        array = _column(table, n, where, described.get(n))
        array = _character_ids(array, n, where) if n in characters else array
        if n == label and array.dtype == object:
            _check_named(array, n, where)
        array = array[order] if order is not None else array
        if matrix is not None and n in numeric:
            matrix[:, list(numeric).index(n)] = array
        else:
            arrays[n] = array
    return {stack: matrix, **arrays} if stack is not None and matrix is not None else arrays


def group_by_client(
    table: Any,
    client: str,
    features: Sequence[str] | None,
    where: str,
    *,
    label: str | None = None,
    stack: str | None = None,
    characters: Sequence[str] = (),
) -> dict[str, dict[str, np.ndarray]]:
    """Rows grouped by the client column, keeping their order within each client; with ``stack``,
    the numeric scalar columns but ``label`` become one vector feature of that name."""
    return _grouped(table, client, features, where, label=label, stack=stack, characters=characters)[0]


def _grouped(
    table: Any,
    client: str,
    features: Sequence[str] | None,
    where: str,
    *,
    label: str | None,
    stack: str | None,
    held_out: tuple[float, int] | None = None,
    characters: Sequence[str] = (),
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    """``group_by_client``'s clients, and with ``held_out`` (a fraction and a seed) each client's
    examples cut as ``split_examples`` cuts them, in the same one copy of the columns in client
    order (the cut took a second copy of the whole table): (train, test)."""
    columns = _column_names(table, where)
    if client not in columns:
        shown = ", ".join(columns[:12]) + (f", ... ({len(columns)} columns)" if len(columns) > 12 else "")
        raise DataSpecError(
            f"table: {where} has no client column {client!r}; its columns are {shown}" + _header_hint(columns)
        )
    ids = table.column(client)
    pa: Any = require("pyarrow")
    nan = 0 if not pa.types.is_floating(ids.type) else int(pa.compute.sum(pa.compute.is_nan(ids)).as_py() or 0)
    if ids.null_count or nan:  # a float column's NaN (not null in Parquet) was a client named 'nan'
        raise DataLayoutError(
            f"table: {where}: client column {client!r} has {ids.null_count + nan} missing values; every row needs a client"
        )
    described = _hf_features(table).get(client)
    if isinstance(described, dict) and described.get("_type") == "ClassLabel" and pa.types.is_integer(ids.type):
        ids = _class_names(ids, described.get("names") or [], client, where)
    names, codes = _client_codes(ids, client, where)
    if "" in names:  # a CSV's empty cell: text, not null, but no client's id either
        empty = int((codes == names.index("")).sum())
        raise DataLayoutError(
            f"table: {where}: client column {client!r} has {empty} empty ids; every row needs a client"
        )
    order = np.argsort(codes, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(codes, minlength=len(names)))]
    cuts = bounds[1:]  # where each client's training rows end
    if held_out is not None:
        fraction, seed = held_out
        check_fraction(fraction)
        parts, ends = [], []
        for i, name in enumerate(names):
            rows = order[bounds[i] : bounds[i + 1]]
            kept, held = example_split(name, len(rows), fraction, seed)
            parts += [rows[kept], rows[held]]
            ends.append(bounds[i] + len(kept))
        order, cuts = np.concatenate(parts) if parts else order, np.asarray(ends, dtype=np.int64)
    arrays = _columns(table, client, features, where, label=label, stack=stack, order=order, characters=characters)
    train, test = {}, {}
    for i, name in enumerate(names):
        train[name] = {n: a[bounds[i] : cuts[i]] for n, a in arrays.items()}
        if cuts[i] < bounds[i + 1]:
            test[name] = {n: a[cuts[i] : bounds[i + 1]] for n, a in arrays.items()}
    return train, test


def _class_names(ids: Any, names: Sequence[str], client: str, where: str) -> Any:
    """A ``ClassLabel`` client column's names for its ids (a client is its name, not its number)."""
    pa: Any = require("pyarrow")
    bounds = pa.compute.min_max(ids).as_py()
    low, high = bounds["min"], bounds["max"]
    if low is not None and (low < 0 or high >= len(names)):
        raise DataLayoutError(
            f"table: {where}: client column {client!r} (a ClassLabel of {len(names)} names) holds the id "
            f"{low if low < 0 else high}; give every row a client"
        )
    return pa.compute.take(pa.array(list(names), pa.string()), ids)


def _client_codes(column: Any, client: str, where: str) -> tuple[list[str], np.ndarray]:
    """The client ids, sorted, and each row's position among them: the column's values as Arrow
    writes them as text (an integer 7 and a float 7.0, as pandas stores an integer column with
    gaps, are both client ``7``), grouped by Arrow's dictionary encoding, not one Python string a row."""
    pa: Any = require("pyarrow")
    pc: Any = require("pyarrow.compute")
    try:
        text = pc.cast(column, pa.string())
    except Exception as exc:  # ArrowNotImplementedError for a list or struct column
        raise DataLayoutError(
            f"table: {where}: client column {client!r} has type {column.type}; client ids must be numbers or text"
        ) from exc
    encoded = text.combine_chunks().dictionary_encode() if len(text) else pa.array([], pa.string()).dictionary_encode()
    found = encoded.dictionary.to_pylist()
    ranks = np.argsort(np.argsort(np.asarray(found, dtype=object), kind="stable"))  # position of each in sorted order
    codes = ranks[encoded.indices.to_numpy(zero_copy_only=False)] if len(found) else np.zeros(0, dtype=np.int64)
    return sorted(found), codes


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
    header: bool = True,
    pad: Mapping[str, tuple[int, float]] | None = None,
    characters: Sequence[str] = (),
) -> FederatedDataset:
    """A table of examples with a client column (``client``) as a federated dataset, or a table of
    one centralized dataset (``client`` None) cut into clients by ``partition`` (flwr-datasets'
    way with a Hugging Face dataset); ``stack=NAME`` makes its numeric scalar columns (of
    ``features``, if given) but the label one vector feature, and ``words`` text columns word ids,
    as ``load_tff_h5`` reads them. ``header=False``: a CSV without a header line, its columns
    named f0, f1, ... ``pad``: list columns padded or cut to one length (``pad_lists``).
    ``characters``: text columns of one length (LEAF's Shakespeare as flwrlabs/shakespeare holds it:
    ``x`` 80 characters, ``y`` the next one) as ids in ``LEAF_CHARACTERS``, as ``load_leaf`` reads them."""
    path = Path(path)
    if characters and words is not None:
        raise DataSpecError("table: characters= and words= each make a vocabulary; give one of them")
    if client is None and partition is None:
        raise DataSpecError(
            f"table: name the client-id column (table:{path},client=COLUMN), or cut the rows into clients "
            "(partition=iid|dirichlet|shards|pathological|quantity)"
        )
    train_table, test_table = _read_arrow(path, client, features, header=header)
    if not train_table.num_rows:  # before its columns, which a CSV's header alone types as null
        raise DataLayoutError(f"table: {path} has no rows")
    if label is None:
        columns = list(train_table.column_names)
        kept = _expand(features, columns, str(path)) if features is not None else columns
        label = next((n for n in ("label", "y") if n in kept and n != client), None)
    described = _hf_features(train_table).get(label) if label is not None else None
    class_names = tuple(described.get("names") or ()) if isinstance(described, dict) else ()
    if test is not None:
        test_table, _ = _read_arrow(Path(test), client, features, header=header)
    test_where = str(test or path)
    if test_table is not None and not test_table.num_rows:  # its header alone types its columns as null
        raise DataLayoutError(
            f"table: the test split of {test_where} has no rows; write the test rows, or leave the test split out "
            "to cut one from the training rows (test_split=, test_fraction=)"
        )
    if pad:
        train_table = pad_lists(train_table, pad, str(path))
        test_table = pad_lists(test_table, pad, test_where) if test_table is not None else None
    if client is None:
        assert partition is not None
        if label is None:
            raise DataSpecError(
                f"table: {path} has no column 'label' or 'y'; name the label to partition by, label=COLUMN"
            )
        arrays = _columns(train_table, None, features, str(path), label=label, stack=stack, characters=characters)
        held = (
            _columns(test_table, None, features, test_where, label=label, stack=stack, characters=characters)
            if test_table
            else None
        )
        del train_table, test_table  # the arrays are what is kept
        vocabulary = words.encode({"": arrays}, {"": held} if held else {}, "table: ") if words is not None else ()
        vocabulary = tuple(LEAF_CHARACTERS) if characters else vocabulary
        return _with_class_names(
            partition_arrays(
                arrays,
                partition,
                label=label,
                seed=seed,
                test_split=test_split,
                test_fraction=test_fraction,
                test=held,
                source=f"table:{path}",
                vocabulary=vocabulary,
            ),
            label,
            class_names,
        )
    if test_split not in ("examples", "clients"):
        raise DataSpecError(f"table: test_split={test_split} is for partitioned data; use examples or clients")
    # the test split cut as the rows are put in client order (a vocabulary counts the rows of both)
    cut = test_table is None and test_split == "examples" and words is None
    train, examples_held = _grouped(
        train_table,
        client,
        features,
        str(path),
        label=label,
        stack=stack,
        held_out=(test_fraction, seed) if cut else None,
        characters=characters,
    )
    test_clients = (
        group_by_client(test_table, client, features, test_where, label=label, stack=stack, characters=characters)
        if test_table is not None
        else None
    )
    del train_table, test_table  # the clients' arrays are copies in client order: the tables' memory is freed
    if cut:
        source = f"table:{path}"
        return _with_class_names(
            FederatedDataset(
                train,
                examples_held,
                label=label,
                test_split="examples",
                source=source,
                vocabulary=tuple(LEAF_CHARACTERS) if characters else (),
            ),
            label,
            class_names,
        )
    vocabulary = words.encode(train, test_clients or {}, "table: ") if words is not None else ()
    vocabulary = tuple(LEAF_CHARACTERS) if characters else vocabulary
    data = with_test_split(
        train,
        test=test_clients,
        how="clients" if test_split == "clients" else "examples",
        fraction=test_fraction,
        seed=seed,
        label=label,
        source=f"table:{path}",
        vocabulary=vocabulary,
    )
    return _with_class_names(data, label, class_names)


def _with_class_names(data: FederatedDataset, label: str | None, names: tuple[str, ...]) -> FederatedDataset:
    """``data`` with its label's class names a ``datasets`` ``ClassLabel`` gives (``label_names``),
    once every id in both splits has a name."""
    if not names or data.label_names or label is None or data.features[label].dtype not in ("int64", "int32"):
        return data
    top = int(data.values(label).max(initial=0))
    if top >= len(names):
        raise DataLayoutError(
            f"table: {data.source}: label {label!r} is a ClassLabel of {len(names)} names but holds the id {top}; "
            "give every class a name"
        )
    return named_labels(data, names)
