"""``FORMAT[:PATH][,KEY=VALUE...]``: the one-string data spec that ``fedfleet simulate --data`` takes.

Formats and their options (paths are relative to ``base_dir``, the config file's folder, if given):

- ``leaf:PATH`` (a .json file, a folder of them, or a folder with train/ and test/):
  ``test=PATH``, ``kind=auto|vectors|characters|words``, ``vocab=FILE``, ``vocab_size=N``, ``max_words=N``;
- ``tff-h5:PATH`` (a .h5 file, or a folder with ``*train*.h5`` and ``*test*.h5``): ``test=PATH``, ``label=NAME``,
  ``words=A+B`` (text features read as word ids), ``vocab=FILE``, ``vocab_size=N``, ``max_words=N``,
  ``split=leaf|space`` (words as LEAF's tokenizer finds them, or between spaces as TFF splits them),
  ``lazy=yes|no`` (the training clients' examples read when a device needs them, the default, or now),
  ``chars=FEATURE``, ``window=N`` (80), ``step=N`` (1) (a text feature cut into next-character
  examples x and y as LEAF cuts Shakespeare: TFF's Shakespeare, ``chars=snippets``);
- ``table:PATH,client=COLUMN`` (a .parquet, .csv, .tsv, .jsonl or .arrow file, gzipped too, or a folder of
  them, a ``save_to_disk`` folder or a folder of them, a client each), or ``table:PATH,partition=...``
  (a centralized table cut as npz is, with the partitioner options below): ``test=PATH``,
  ``label=NAME``, ``features=A+B+C`` (a name or a pattern, ``pixel*``), ``stack=NAME`` (the numeric
  columns but the label as one vector), ``header=yes|no`` (a CSV without a header line: columns f0,
  f1, ...), ``pad=NAME:LENGTH[:VALUE]+...`` (lists of numbers of different lengths padded with the
  value, 0 unless given, or cut), ``characters=A+B`` (text columns of one length as ids in LEAF's
  80 characters, as leaf: reads Shakespeare: flwrlabs/shakespeare's ``characters=x+y``), and ``words``,
  ``vocab``, ``vocab_size``, ``max_words``, ``split`` as for tff-h5;
- ``npz:PATH`` (arrays ``x`` and ``y``, or Keras' ``x_train`` and ``y_train``, and ``x_test``/``y_test``
  if the file has them) and ``digits``
  (scikit-learn's 1,797 digits, no path), cut by a partitioner: ``partition=iid|dirichlet|shards|
  pathological|quantity``, ``clients=N`` (100), ``alpha=A`` (0.5), ``shards=K`` (2), ``classes=K`` (2),
  ``mode=random|deterministic|first-deterministic``, ``sigma=S`` (1.0), ``min_size=N`` (1).

Every format also takes ``test_split=examples|clients|none`` (how to cut a test split when the files
bring none; ``none`` only for npz and digits), ``test_fraction=F``, ``seed=N`` and
``rename=OLD:NEW+OLD2:NEW2`` (features named as the task's plan reads them, the label included).
A path may hold commas: a piece that is no option is the rest of the path when the two name an
existing file or folder.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from emulator.datasets import digits_arrays
from server_stub.errors import did_you_mean

from ._dataset import FederatedDataset
from ._errors import DataLayoutError, DataSpecError, check_finite, check_fits, check_readable, readable_fix
from .leaf import load_leaf
from .partition import SCHEMES, Partitioner, partition_arrays
from .table import load_table
from .text import DEFAULT_VOCAB_SIZE, LEAF_MAX_WORDS, LEAF_WINDOW, SPLITS, CharWindows, WordIds
from .tff_h5 import load_tff_h5

_COMMON = frozenset({"test_split", "test_fraction", "seed", "rename"})
_WORDS = frozenset({"words", "vocab", "vocab_size", "max_words", "split"})
_PARTITION = frozenset({"partition", "clients", "alpha", "shards", "classes", "mode", "sigma", "min_size"})
OPTIONS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "leaf": _COMMON | {"test", "kind", "vocab", "vocab_size", "max_words"},
        "tff-h5": _COMMON | _WORDS | {"test", "label", "lazy", "chars", "window", "step"},
        "table": _COMMON
        | _WORDS
        | _PARTITION
        | {"client", "test", "label", "features", "stack", "header", "pad", "characters"},
        "npz": _COMMON | _PARTITION,
        "digits": _COMMON | _PARTITION,
    }
)
FORMATS: tuple[str, ...] = tuple(OPTIONS)
_PATH_OPTIONS = ("test", "vocab")
_INTS = ("vocab_size", "max_words", "clients", "shards", "classes", "min_size", "seed", "window", "step")
_FLOATS = ("alpha", "sigma", "test_fraction")
EXAMPLE = (
    "leaf:data/femnist, tff-h5:fed_emnist_train.h5, table:data.parquet,client=user_id, "
    "npz:data.npz,partition=dirichlet, digits"
)


@dataclass(frozen=True)
class DataSpec:
    """A parsed data spec: the format, its path (None for ``digits``) and its options as given."""

    format: str
    path: Path | None
    options: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        head = self.format + (f":{self.path}" if self.path is not None else "")
        return ",".join([head, *(f"{k}={v}" for k, v in self.options.items())])

    def int_option(self, key: str, default: int) -> int:
        return int(self.options.get(key, default))

    def float_option(self, key: str, default: float) -> float:
        return float(self.options.get(key, default))


_BY_SUFFIX = {
    **dict.fromkeys((".csv", ".tsv", ".parquet", ".jsonl", ".gz", ".arrow", ".feather"), "table:{},client=COLUMN"),
    ".json": "leaf:{}",
    ".h5": "tff-h5:{}",
    ".hdf5": "tff-h5:{}",
    ".npz": "npz:{}",
}


def _as_spec(head: str) -> str:
    """The spec a bare path or a file type given as the format most likely meant, or ''."""
    fmt, sep, rest = head.strip().partition(":")
    path = rest.strip() if sep and f".{fmt.lower()}" in _BY_SUFFIX else head.strip()
    form = _BY_SUFFIX.get(Path(path).suffix.lower()) or _BY_SUFFIX.get(f".{fmt.lower()}")
    return f"give the format before the path: {form.format(path)}" if form else ""


def _missing(path: Path) -> str:
    """Why ``path`` cannot be opened, said as what to do ("" when it can): a link to nothing or a
    link that loops (which ``exists()`` calls missing alike), a folder on its way this user may not enter."""
    try:
        path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            return f"is a symbolic link to {os.readlink(path)}, which does not exist; link it to the data"
        return "does not exist"
    except PermissionError:
        return "cannot be reached: permission denied on a folder on its way; make the folders above it searchable (chmod a+x)"
    except OSError as exc:  # ELOOP: a link to itself, or links in a circle
        return f"cannot be opened ({exc.strerror}: a symbolic link that loops); link it to the data itself"
    return ""


def _pieces(text: str, options: frozenset[str], resolve: Callable[[str], Path]) -> list[str]:
    """The spec cut at its commas, but for the commas of a path: a piece that is no option of the
    format (``d`` or ``d/t.parquet`` of ``leaf:runs/c,d/t.parquet``) is the rest of the path (or
    of a path option's value, ``test=``) before it when together they name a file or folder."""
    pieces: list[str] = []
    for piece in text.split(","):
        if pieces and piece.partition("=")[0].strip() not in options:
            joined = f"{pieces[-1]},{piece}"
            value = joined.partition(":")[2] if len(pieces) == 1 else joined.partition("=")[2]
            if value.strip() and os.path.lexists(resolve(value.strip())):
                pieces[-1] = joined
                continue
        pieces.append(piece)
    return pieces


def parse_data_spec(text: str, *, base_dir: str | Path | None = None) -> DataSpec:
    """Check a spec's format, path and options; the error names the first thing wrong."""
    text = text.strip()
    if not text:
        raise DataSpecError(f"empty data spec; give FORMAT:PATH[,KEY=VALUE...], e.g. {EXAMPLE}")
    base = Path(base_dir) if base_dir is not None else None

    def resolve(p: str) -> Path:
        path = Path(p).expanduser()
        return base / path if base is not None and not path.is_absolute() else path

    fmt = text.partition(":")[0].partition(",")[0].strip().lower()
    if fmt not in OPTIONS:
        head = text.split(",")[0]
        raise DataSpecError(
            f"unknown data format {fmt!r}{did_you_mean(fmt, FORMATS)} in {text!r}; "
            + (_as_spec(head) or f"use one of {', '.join(FORMATS)} (e.g. {EXAMPLE})")
        )
    head, *pairs = _pieces(text, OPTIONS[fmt], resolve)
    raw_path = head.partition(":")[2]
    sep = ":" if ":" in head else ""
    options: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise DataSpecError(
                f"{fmt}: option {pair.strip()!r} is not KEY=VALUE; a comma parts the options, and one in a path is "
                "read as the path's only when the path with it exists"
            )
        if key not in OPTIONS[fmt]:
            raise DataSpecError(
                f"{fmt}: unknown option {key!r}{did_you_mean(key, OPTIONS[fmt])}; "
                f"{fmt} takes {', '.join(sorted(OPTIONS[fmt]))}"
            )
        if key in options:
            raise DataSpecError(f"{fmt}: option {key!r} is given twice")
        options[key] = value
    path: Path | None = None
    if fmt == "digits":
        if raw_path.strip():
            raise DataSpecError(
                "digits takes no path (it ships with scikit-learn); write 'digits' or 'digits,clients=100'"
            )
    else:
        if not sep or not raw_path.strip():
            raise DataSpecError(f"{fmt}: give a path, as {fmt}:PATH")
        path = resolve(raw_path.strip())
        missing = _missing(path)
        if missing:
            raise DataSpecError(f"{fmt}: {path} {missing}")
    for key in _PATH_OPTIONS:
        if key in options:
            resolved = resolve(options[key])
            missing = _missing(resolved)
            if missing:
                raise DataSpecError(f"{fmt}: {key}={resolved} {missing}")
            options[key] = str(resolved)
    for key in _INTS:
        if key in options:
            try:
                int(options[key])
            except ValueError:
                raise DataSpecError(f"{fmt}: option {key}={options[key]!r} is not a whole number") from None
    for key in _FLOATS:
        if key in options:
            try:
                number = float(options[key])
            except ValueError:
                raise DataSpecError(f"{fmt}: option {key}={options[key]!r} is not a number") from None
            if not np.isfinite(number):
                raise DataSpecError(f"{fmt}: option {key}={options[key]!r} must be finite")
    if fmt == "table" and "client" not in options and "partition" not in options:
        raise DataSpecError(
            f"table: name the client-id column, e.g. table:{path},client=user_id, or cut the rows into clients "
            f"with partition={'|'.join(SCHEMES)}"
        )
    if fmt == "table" and "client" in options and "partition" in options:
        raise DataSpecError("table: give client=COLUMN (the table's own clients) or partition=... (cut it), not both")
    if fmt == "table" and "client" in options and set(options) & (_PARTITION - {"partition"}):
        raise DataSpecError(
            f"table: {', '.join(sorted(set(options) & _PARTITION))}: options of a table cut into clients with "
            "partition=...; this one's clients are its client column's"
        )
    if "rename" in options:
        renames(DataSpec(fmt, path, MappingProxyType(options)))  # says now what is wrong with it
    if "pad" in options:
        pads(DataSpec(fmt, path, MappingProxyType(options)))
    if "words" not in options and "split" in options:
        raise DataSpecError(f"{fmt}: split= cuts the texts words=A+B names into words; give words= too")
    if options.get("split", "leaf") not in SPLITS:
        raise DataSpecError(
            f"{fmt}: split={options['split']!r} is unknown; use leaf (LEAF's tokenizer) or space (TFF's)"
        )
    if "chars" not in options and {"window", "step"} & set(options):
        raise DataSpecError(f"{fmt}: window= and step= cut the text chars=FEATURE names; give chars= too")
    if "partition" in options and options["partition"] not in SCHEMES:
        raise DataSpecError(f"{fmt}: partition={options['partition']!r} is unknown; use one of {', '.join(SCHEMES)}")
    for key in ("lazy", "header"):
        if options.get(key, "yes") not in ("yes", "no"):
            raise DataSpecError(f"{fmt}: {key}={options[key]!r} is unknown; use yes or no")
    split = options.get("test_split")
    partitioned = fmt in ("npz", "digits") or "partition" in options
    allowed = ("examples", "clients", "none") if partitioned else ("examples", "clients")
    if split is not None and split not in allowed:
        raise DataSpecError(f"{fmt}: test_split={split!r} is unknown; use one of {', '.join(allowed)}")
    return DataSpec(fmt, path, MappingProxyType(options))


def renames(spec: DataSpec) -> dict[str, str]:
    """``rename=OLD:NEW+OLD2:NEW2`` as old name -> new name."""
    out: dict[str, str] = {}
    for pair in spec.options.get("rename", "").split("+") if "rename" in spec.options else ():
        old, colon, new = (part.strip() for part in pair.partition(":"))
        if not colon or not old or not new or ":" in new:
            raise DataSpecError(
                f"{spec.format}: rename={spec.options['rename']!r}: {pair!r} is not OLD:NEW; "
                "write rename=label:y, or rename=pixels:x+label:y for several"
            )
        if old in out:
            raise DataSpecError(f"{spec.format}: rename names {old!r} twice")
        out[old] = new
    return out


def pads(spec: DataSpec) -> dict[str, tuple[int, float]]:
    """``pad=NAME:LENGTH[:VALUE]+...`` as name -> (length, value); the value is 0 unless given."""
    out: dict[str, tuple[int, float]] = {}
    for item in spec.options["pad"].split("+") if "pad" in spec.options else ():
        name, *rest = (part.strip() for part in item.split(":"))
        try:
            length, value = int(rest[0]), (float(rest[1]) if len(rest) == 2 else 0.0)
            if not name or len(rest) > 2 or length < 1 or not np.isfinite(value):
                raise ValueError(item)
        except (IndexError, ValueError):
            raise DataSpecError(
                f"{spec.format}: pad={spec.options['pad']!r}: {item!r} is not NAME:LENGTH or NAME:LENGTH:VALUE; "
                "write pad=input_ids:128 (padded with 0), or pad=input_ids:128:1+attention_mask:128"
            ) from None
        if name in out:
            raise DataSpecError(f"{spec.format}: pad names {name!r} twice")
        out[name] = (length, value)
    return out


def _partitioner(spec: DataSpec) -> Partitioner:
    return Partitioner(
        scheme=spec.options.get("partition", "iid"),  # type: ignore[arg-type]
        num_clients=spec.int_option("clients", 100),
        alpha=spec.float_option("alpha", 0.5),
        shards_per_client=spec.int_option("shards", 2),
        classes_per_client=spec.int_option("classes", 2),
        mode=spec.options.get("mode", "first-deterministic"),  # type: ignore[arg-type]
        sigma=spec.float_option("sigma", 1.0),
        min_size=spec.int_option("min_size", 1),
    )


def _npz_array(data: Any, key: str, path: Path) -> np.ndarray:
    """One array of an .npz file, once its header's shape fits in memory; an object array (which
    only unpickling reads) is refused, as the file's pickles are never run."""
    where = f"npz: {path}: array {key!r}"
    try:
        with data.zip.open(f"{key}.npy") as member:
            version = np.lib.format.read_magic(member)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(member)
    except (KeyError, ValueError, OSError, zipfile.BadZipFile, zlib.error, EOFError):  # a header numpy reads on
        pass  # its own (3.0), or not one, or damaged bytes: reading the array says which
    else:
        check_fits(where, dtype, shape, dtype.itemsize)
    try:
        return data[key]
    except ValueError as exc:
        if "pickle" not in str(exc):  # a header numpy cannot parse: bytes of the file overwritten
            raise DataLayoutError(f"{where} is damaged ({str(exc)[:120]}); copy or save the file again") from None
        raise DataLayoutError(
            f"{where} cannot be read without running pickled code ({exc}); save plain arrays"
        ) from None
    except MemoryError:
        raise DataLayoutError(f"{where} does not fit in memory") from None
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # a bad CRC, a deflated stream cut short
        raise DataLayoutError(
            f"{where} is damaged ({exc or type(exc).__name__}); copy or save the file again"
        ) from None


def _read_npz(path: Path) -> Mapping[str, np.ndarray]:
    check_readable(path, "npz: ")
    try:
        loaded = np.load(path, allow_pickle=False)
    except EOFError:  # numpy's word for a file of no bytes, which is neither a zip nor an array
        raise DataLayoutError(
            f"npz: {path} is empty (0 bytes); save x and y with np.savez(path, x=..., y=...), or copy the file again"
        ) from None
    except zipfile.BadZipFile as exc:  # a zip's start without its end (the directory): a copy cut short
        raise DataLayoutError(
            f"npz: {path} is not a whole .npz file ({exc}: its end is missing, as in a copy cut short); copy or save "
            "it again"
        ) from None
    except (OSError, ValueError) as exc:
        why = "it reads as a pickle, which is never loaded" if "pickle" in str(exc) else str(exc)
        raise DataLayoutError(f"npz: {path} is not a .npz file of arrays ({why})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):  # np.save's .npy: one array without a name
        raise DataLayoutError(f"npz: {path} is one array (a .npy file); save x and y with np.savez(path, x=..., y=...)")
    with loaded as data:
        arrays = {k: check_finite(_npz_array(data, k, path), f"npz: {path}: array {k!r}") for k in data.files}
    if "x" not in arrays and "y" not in arrays and "x_train" in arrays and "y_train" in arrays:
        arrays["x"], arrays["y"] = arrays.pop("x_train"), arrays.pop("y_train")  # Keras' mnist.npz, cifar's
    for key in ("x", "y"):
        if key not in arrays:
            found = ", ".join(sorted(arrays)) or "none"
            raise DataLayoutError(
                f"npz: {path} has no array {key!r} (arrays: {found}); save x and y (or x_train and y_train)"
            )
    for key in ("x", "y", "x_test", "y_test"):  # len() of a 0-d array is a TypeError
        if key in arrays and arrays[key].ndim == 0:
            raise DataLayoutError(
                f"npz: {path}: array {key!r} is a single value (shape ()), not one per example; save "
                f"an array whose first axis runs over the examples"
            )
    if len(arrays["x"]) == 0:  # else partitioned into "at most 0 clients"
        raise DataLayoutError(f"npz: {path}: array 'x' holds no example; save the examples to train on")
    for key in ("y", "y_test"):  # Keras' CIFAR labels are [N, 1]: class ids, one per example
        if key in arrays and arrays[key].ndim == 2 and arrays[key].shape[1] == 1:
            arrays[key] = arrays[key][:, 0]
    return arrays


def _digits() -> dict[str, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits scaled to [0, 1], as ``emulator.datasets`` scales them."""
    x, y = digits_arrays()  # cached and shared between loads, read-only
    return {"x": x, "y": y}


def load_data(spec: str | DataSpec, *, seed: int | None = None, base_dir: str | Path | None = None) -> FederatedDataset:
    """The federated dataset a spec names; ``seed`` is used unless the spec sets its own."""
    if isinstance(spec, str):
        spec = parse_data_spec(spec, base_dir=base_dir)
    try:
        data = _load(spec, seed)
    except PermissionError as exc:  # a file or folder inside the path, which the readers did not check first
        name = Path(exc.filename or str(spec.path))
        while name.parent != name and not os.access(name.parent, os.X_OK):  # the folder that keeps it out
            name = name.parent
        raise DataSpecError(
            f"{spec.format}: {name} cannot be read: permission denied; {readable_fix(name, os.path.isdir(name))}"
        ) from None
    cutting = [k for k in ("test_split", "test_fraction") if k in spec.options]
    if cutting and data.test_split in ("files", "central"):  # an option that would have been ignored
        given = ", ".join(f"{k}={spec.options[k]}" for k in cutting)
        own = {"leaf": "its test/ folder", "tff-h5": "the *test*.h5 file beside it", "npz": "x_test and y_test"}
        held = f"test={spec.options['test']}" if "test" in spec.options else own.get(spec.format, "its test split")
        raise DataSpecError(
            f"{spec.format}: {given} would cut a test split from the training data, but {spec.path} brings its own "
            f"({held}), which is the test split; leave {' and '.join(cutting)} out, or give the training data alone"
        )
    if "rename" not in spec.options:
        return data
    names = renames(spec)
    stacked = sorted(set(names) - set(data.features)) if data.label is None and "stack" in spec.options else []
    if stacked:  # a label column the loader did not find is one of the stacked ones
        raise DataLayoutError(
            f"rename: {', '.join(map(repr, stacked))} is not a feature of {data.source}, whose features are "
            f"{', '.join(data.features)}: stack={spec.options['stack']} holds every numeric column but the label, "
            f"and without label= the label is a column named label or y, which it has not; if {stacked[0]!r} is "
            f"the label, name it with label={stacked[0]}"
        )
    return data.renamed(names)


def _load(spec: DataSpec, seed: int | None) -> FederatedDataset:
    opts = spec.options
    run_seed = spec.int_option("seed", 0 if seed is None else seed)
    split: Any = opts.get("test_split", "examples")
    partitioned = spec.format in ("npz", "digits") or "partition" in opts
    fraction = spec.float_option("test_fraction", 0.2 if partitioned else 0.1)
    common: dict[str, Any] = {"test_split": split, "test_fraction": fraction, "seed": run_seed}
    assert spec.path is not None or spec.format == "digits"
    if spec.format == "leaf":
        return load_leaf(
            spec.path,  # type: ignore[arg-type]
            test=opts.get("test"),
            kind=opts.get("kind", "auto"),  # type: ignore[arg-type]
            vocab=opts.get("vocab"),
            vocab_size=spec.int_option("vocab_size", DEFAULT_VOCAB_SIZE),
            max_words=spec.int_option("max_words", LEAF_MAX_WORDS),
            **common,
        )
    words = (
        WordIds(
            tuple(opts["words"].split("+")),
            vocab=opts.get("vocab"),
            vocab_size=spec.int_option("vocab_size", DEFAULT_VOCAB_SIZE),
            max_words=spec.int_option("max_words", LEAF_MAX_WORDS),
            split=opts.get("split", "leaf"),  # type: ignore[arg-type]
        )
        if "words" in opts
        else None
    )
    if spec.format == "tff-h5":
        lazy = opts.get("lazy", "yes") == "yes"
        chars = (
            CharWindows(opts["chars"], spec.int_option("window", LEAF_WINDOW), spec.int_option("step", 1))
            if "chars" in opts
            else None
        )
        return load_tff_h5(
            spec.path,  # type: ignore[arg-type]
            test=opts.get("test"),
            label=opts.get("label"),
            words=words,
            lazy=lazy,
            chars=chars,
            **common,
        )
    if spec.format == "table":
        columns = opts["features"].split("+") if "features" in opts else None
        assert spec.path is not None
        return load_table(
            spec.path,
            client=opts.get("client"),
            partition=_partitioner(spec) if "partition" in opts else None,
            test=opts.get("test"),
            label=opts.get("label"),
            features=columns,
            stack=opts.get("stack"),
            words=words,
            header=opts.get("header", "yes") == "yes",
            pad=pads(spec),
            characters=tuple(opts["characters"].split("+")) if "characters" in opts else (),
            **common,
        )
    if spec.format == "npz":
        arrays = _read_npz(spec.path)  # type: ignore[arg-type]
        test = {"x": arrays["x_test"], "y": arrays["y_test"]} if "x_test" in arrays and "y_test" in arrays else None
        features, label = {"x": arrays["x"], "y": arrays["y"]}, "y"
    else:
        features, label, test = _digits(), "y", None
    return partition_arrays(
        features,
        _partitioner(spec),
        label=label,
        seed=run_seed,
        test_split=split,
        test_fraction=fraction,
        test=test,
        source=str(spec),
    )
