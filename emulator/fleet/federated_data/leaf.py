"""LEAF's JSON layout (Caldas et al. 2018, github.com/TalwalkarLab/leaf), read from local files.

A LEAF file is one JSON object: ``users`` (the ids), ``num_samples`` (examples per user, in the same
order) and ``user_data`` (user -> ``{"x": [...], "y": [...]}``), optionally ``hierarchies``
(ignored). LEAF's ``split_data.py`` writes a dataset as ``train/`` and ``test/`` folders of such
files (``--by_sample``: the same users in both; ``--by_user``: different users); a user's entries
never span two files of one split. What ``x`` and ``y`` hold depends on the dataset, and each
becomes the features ``x`` and ``y`` (``y`` is the label):

- FEMNIST: ``x`` lists of 784 floats in [0, 1] (28x28 images), ``y`` class ids 0-61 ->
  ``x`` float32 [784], ``y`` int64; LEAF's synthetic data the same with ``num_dim`` floats.
- Shakespeare: ``x`` strings of 80 characters, ``y`` the next character -> both as ids in LEAF's
  80-character set (``text.LEAF_CHARACTERS``): ``x`` uint8 [80], ``y`` uint8.
- Sent140: ``x`` the tweet's CSV row without its polarity (id, date, query, user, text), ``y`` 0 or
  1 -> ``x`` [max_words] word ids of the text (the row's last field), ``y`` int64; the ids are
  uint16 for a vocabulary of up to 65,535 words (``text.id_dtype``), int32 for GloVe's 400,000.

Ids are held narrow (a fleet casts them to the dtype its plan reads as it feeds them).

``kind="auto"`` tells these apart by the first training example: a string ``y`` is the next
character; a string ``x`` (or a row ending in one) with a numeric ``y`` is a text to classify; lists of
numbers are vectors. LEAF's own reader keys users by ``user_data``; here ``users`` and
``num_samples`` must agree with it (a user listed without data, or a count that differs, is an
error), except that users with no examples, which LEAF's by-sample split leaves in ``user_data``,
are skipped.
"""

from __future__ import annotations

import codecs
import json
import numbers
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ._dataset import FederatedDataset, with_test_split
from ._errors import DataLayoutError, DataSpecError, check_link, check_readable
from .text import (
    DEFAULT_VOCAB_SIZE,
    LEAF_CHARACTERS,
    LEAF_MAX_WORDS,
    build_vocabulary,
    encode_characters,
    encode_words,
    read_vocabulary,
)

LeafKind = Literal["auto", "vectors", "characters", "words"]
KINDS: tuple[str, ...] = ("auto", "vectors", "characters", "words")

_Raw = dict[str, tuple[list[Any] | np.ndarray, list[Any], Path]]
_IMAGE_FILES = (".jpg", ".jpeg", ".png", ".bmp", ".gif")


def _json_files(path: Path) -> list[Path]:
    """A file, or a folder's ``.json`` files in sorted order but those whose names start with ``.``
    (the ``._name.json`` macOS writes beside each file it copies to another file system)."""
    if path.is_file():
        return [path]
    if not path.exists():
        raise DataSpecError(f"leaf: {path} does not exist")
    if not path.is_dir():  # a device or a pipe: read, /dev/zero would never end
        raise DataSpecError(f"leaf: {path} is neither a file nor a folder; give a .json file or a folder of them")
    check_readable(path, "leaf: ")
    listed = [p for p in path.iterdir() if p.suffix == ".json" and not p.name.startswith(".")]
    for p in listed:
        check_link(p, "leaf: ")
    files = sorted(p for p in listed if p.is_file())
    if not files:
        raise DataLayoutError(
            f"leaf: {path} holds no .json files; a LEAF dataset is a .json file, a folder of them, "
            "or a folder with train/ and test/ folders of them (what LEAF's split_data.py writes)"
        )
    return files


def leaf_files(path: Path, test: Path | None = None) -> tuple[list[Path], list[Path]]:
    """The training and test files a path names: a file, a folder of files, or train/ and test/."""
    check_readable(path, "leaf: ")
    if path.is_dir() and (path / "train").is_dir():
        train = _json_files(path / "train")
        test_files = _json_files(path / "test") if (path / "test").is_dir() and test is None else []
    else:
        train = _json_files(path)
        test_files = []
    if test is not None:
        test_files = _json_files(test)
    return train, test_files


def _packed(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as it is parsed, a user's ``x`` of number lists as one array: a file's floats as
    Python objects (32 bytes each) were all held until the whole file was parsed, now one user's.
    An ``x`` of text (Sent140's rows), or of lists that are ragged or hold an integer past int64,
    stays as parsed, to be converted or refused with its user named."""
    out = dict(pairs)
    x = out.get("x")
    row = x[0] if isinstance(x, list) and x else None
    if isinstance(row, list) and not (row and isinstance(row[-1], str)) and "y" in out:  # not Sent140's rows
        try:
            array = np.array(x)
        except (ValueError, TypeError, OverflowError):  # ragged
            return out
        if array.ndim > 1 and array.dtype.kind in "biuf":
            out["x"] = array
    return out


def _start(path: Path) -> str:
    """The file's encoding, once it starts as a JSON object does: a file of anything else (2 GB of
    zeros, a CSV named .json) was parsed whole, 10 s and 4 GB of memory, to say it is not JSON. A
    byte-order mark (what Windows' editors and PowerShell write) is read past."""
    with path.open("rb") as f:
        head = f.read(1 << 12)
    bom = head.startswith(codecs.BOM_UTF8)
    start = head.removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n")
    if not start.startswith((b"{", b"[")):
        shown = repr(start[:16])[2:-1] + ("..." if len(start) > 16 else "") if start else "nothing"
        raise DataLayoutError(
            f"{path}: not a LEAF file: it starts with {shown}, where a LEAF file is one JSON object "
            "(users, num_samples, user_data); give LEAF's JSON files"
        )
    return "utf-8-sig" if bom else "utf-8"


def _read_file(path: Path) -> Mapping[str, Any]:
    check_readable(path, "leaf: ")
    encoding = _start(path)
    try:
        with path.open("r", encoding=encoding) as f:
            data = json.load(f, object_pairs_hook=_packed)
    except json.JSONDecodeError as exc:
        ends = exc.pos >= len(exc.doc.rstrip()) or exc.msg.startswith("Unterminated string")
        raise DataLayoutError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
            + ("; it ends in the middle of its data, as a copy cut short does: copy or write it again" if ends else "")
        ) from None
    except UnicodeDecodeError as exc:
        raise DataLayoutError(f"{path}: not UTF-8 text; a LEAF file is JSON") from exc
    except ValueError:  # an integer of more digits than Python converts (4,300): no LEAF value is one
        raise DataLayoutError(f"{path}: holds an integer of thousands of digits; LEAF's values are floats") from None
    except RecursionError:  # lists nested deeper than the parser recurses: no LEAF x is more than 3 deep
        raise DataLayoutError(f"{path}: holds lists nested thousands deep; a LEAF x is a list of numbers") from None
    if not isinstance(data, dict):
        raise DataLayoutError(
            f"{path}: a LEAF file is a JSON object with users, num_samples and user_data, not a {type(data).__name__}"
        )
    for key in ("users", "user_data"):
        if key not in data:
            raise DataLayoutError(
                f"{path}: no {key!r} key (found: {', '.join(sorted(map(str, data))) or 'nothing'}); "
                "a LEAF file holds users, num_samples and user_data"
            )
    return data


def _read_split(files: Sequence[Path]) -> Iterator[_Raw]:
    """Each file's users with examples, one file at a time: converted before the next is read, a
    split's JSON lists of Python floats (36 bytes a value) are never held all at once."""
    seen: dict[str, Path] = {}
    for path in files:
        raw: _Raw = {}
        data = _read_file(path)
        users, user_data = data["users"], data["user_data"]
        if not isinstance(users, list) or not all(isinstance(u, (str, int)) for u in users):
            raise DataLayoutError(f"{path}: 'users' must be a list of user ids")
        if not isinstance(user_data, dict):
            raise DataLayoutError(f"{path}: 'user_data' must be an object from user id to its x and y")
        counts = data.get("num_samples")
        if counts is not None and (not isinstance(counts, list) or len(counts) != len(users)):
            raise DataLayoutError(
                f"{path}: 'num_samples' must list one count per user ({len(users)} users, "
                f"{len(counts) if isinstance(counts, list) else 'not a list'})"
            )
        listed = {str(u) for u in users}
        for i, user in enumerate(map(str, users)):
            if user not in user_data:
                raise DataLayoutError(f"{path}: user {user!r} is listed in 'users' but has no entry in 'user_data'")
            entry = user_data[user]
            if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
                raise DataLayoutError(f"{path}: user_data[{user!r}] must be an object with 'x' and 'y' lists")
            x, y = entry["x"], entry["y"]
            if not isinstance(x, (list, np.ndarray)) or not isinstance(y, list):
                raise DataLayoutError(f"{path}: user_data[{user!r}]'s 'x' and 'y' must be lists")
            if len(x) != len(y):
                raise DataLayoutError(
                    f"{path}: user {user!r} has {len(x)} x but {len(y)} y; each example needs one of each"
                )
            if counts is not None and (not isinstance(counts[i], numbers.Real) or isinstance(counts[i], bool)):
                raise DataLayoutError(
                    f"{path}: num_samples gives user {user!r} {counts[i]!r} examples; a count is a JSON number"
                )
            if counts is not None and counts[i] != len(y):
                raise DataLayoutError(
                    f"{path}: num_samples says user {user!r} has {counts[i]} examples but user_data holds {len(y)}; "
                    "fix num_samples or the data"
                )
            if user in seen:
                raise DataLayoutError(
                    f"{path}: 'users' lists {user!r} twice (a JSON number and a string are one user id); list each user once"
                    if seen[user] == path
                    else f"{path}: user {user!r} also appears in {seen[user]}; a user belongs to one file of a split"
                )
            seen[user] = path
            if y:
                raw[user] = (x, y, path)
        for user, entry in user_data.items():
            if (
                user not in listed
                and isinstance(entry, dict)
                and (len(entry.get("y") or ()) or len(entry.get("x", ())))
            ):
                raise DataLayoutError(
                    f"{path}: user_data holds user {user!r} that 'users' does not list; add it to users"
                )
        del data, user_data
        yield raw


def _detect(raw: _Raw) -> str:
    for x, y, path in raw.values():
        x0, y0 = (list(x[0]) if isinstance(x, np.ndarray) else x[0]), y[0]
        if isinstance(x0, str) and x0.lower().endswith(_IMAGE_FILES):
            raise DataLayoutError(
                f"{path}: x holds image file names ({x0!r}, as LEAF's CelebA writes them), not the images; write "
                "each image's pixels as x (a list of floats), or save them in a table with an Image column"
            )
        if isinstance(y0, dict):
            raise DataLayoutError(
                f"{path}: y holds objects ({', '.join(sorted(map(str, y0)))}, as LEAF's Reddit writes them); "
                "this loader reads a class id or a next character as y"
            )
        if isinstance(y0, str):
            return "characters"
        if isinstance(x0, str) or (isinstance(x0, list) and x0 and isinstance(x0[-1], str)):
            return "words"
        if isinstance(x0, (list, numbers.Number)) and not isinstance(x0, bool):
            return "vectors"
        raise DataLayoutError(
            f"{path}: cannot tell what x holds ({type(x0).__name__}); give kind=vectors, characters or words"
        )
    raise DataLayoutError("no user has any example")


def _text_of(item: Any, user: str, path: Path) -> str:
    text = item if isinstance(item, str) else (item[-1] if isinstance(item, list) and item else None)
    if not isinstance(text, str):
        raise DataLayoutError(f"{path}: user {user!r} has an x that is neither a text nor a row ending in one")
    return text


def _labels(y: list[Any], user: str, path: Path) -> np.ndarray:
    if not all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in y):
        raise DataLayoutError(f"{path}: user {user!r} has a y that is not a number")
    try:
        arr = np.asarray(y, dtype=np.int64) if all(isinstance(v, int) for v in y) else np.asarray(y, dtype=np.float64)
    except OverflowError:  # an integer past int64's range
        arr = np.asarray([float("inf")])
    if arr.dtype.kind == "f" and not (np.isfinite(arr).all() and np.abs(arr).max(initial=0) < 2**63):
        raise DataLayoutError(
            f"{path}: user {user!r} has a y that is NaN, infinite or past int64's range; fix or drop that example"
        )
    if arr.dtype.kind == "i" or np.all(np.mod(arr, 1) == 0):
        return arr.astype(np.int64)
    return arr.astype(np.float32)


def _convert(raw: _Raw, kind: str, vocab: Sequence[str], max_words: int) -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for user, (x, y, path) in raw.items():
        if kind == "characters":
            if not all(isinstance(s, str) for s in x) or not all(isinstance(c, str) and len(c) == 1 for c in y):
                raise DataLayoutError(
                    f"{path}: user {user!r}: next-character data needs x strings and y single characters"
                )
            lengths = {len(s) for s in x}
            if len(lengths) != 1:
                raise DataLayoutError(
                    f"{path}: user {user!r} has x strings of lengths {sorted(lengths)[:2]}; "
                    "next-character windows must all have one length (LEAF's Shakespeare: 80)"
                )
            xs = encode_characters("".join(x)).reshape(len(x), lengths.pop())
            ys = encode_characters("".join(y))
            out[user] = {"x": xs, "y": ys}
        elif kind == "words":
            out[user] = {
                "x": encode_words([_text_of(i, user, path) for i in x], vocab, max_words),
                "y": _labels(y, user, path),
            }
        else:
            overflow = False
            try:
                with np.errstate(over="ignore"):  # a value past float32's range becomes inf, refused below
                    xs = np.asarray(x, dtype=np.float32)
            except (ValueError, TypeError) as exc:
                raise DataLayoutError(
                    f"{path}: user {user!r} has x vectors of different lengths or non-numbers; every x needs the same length"
                ) from exc
            except OverflowError:  # an integer past any float's range (JSON numbers have no limit)
                overflow = True
            if overflow or not np.isfinite(xs).all():  # NaN and Infinity parse as JSON here; 1e39 is float32's inf
                raise DataLayoutError(
                    f"{path}: user {user!r} has an x value that is NaN, infinite or past float32's range (3.4e38); "
                    "fix or drop that example"
                )
            if xs.ndim == 1:
                xs = xs[:, None]
            out[user] = {"x": xs, "y": _labels(y, user, path)}
    return out


def _drain(stack: list[_Raw]) -> Iterator[_Raw]:
    while stack:
        yield stack.pop()


def _convert_all(
    files: Iterator[_Raw], kind: str, vocab: Sequence[str], max_words: int
) -> dict[str, dict[str, np.ndarray]]:
    """Every file's users converted, each file's lists dropped before the next file is read."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for raw in files:
        out.update(_convert(raw, kind, vocab, max_words))
        del raw
    return out


def load_leaf(
    path: str | Path,
    *,
    test: str | Path | None = None,
    kind: LeafKind = "auto",
    vocab: str | Path | Sequence[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_words: int = LEAF_MAX_WORDS,
    test_split: Literal["examples", "clients"] = "examples",
    test_fraction: float = 0.1,
    seed: int = 0,
) -> FederatedDataset:
    """A LEAF dataset from a file, a folder of files, or a folder with ``train/`` and ``test/``.

    Without test files, the test split is cut from the training data: a seeded share of each user's
    examples (``test_split="examples"``, LEAF's default ``--by_sample`` at ``--frac 0.9``) or whole
    users held out (``"clients"``, LEAF's ``--by_user``).
    """
    if kind not in KINDS:
        raise DataSpecError(f"leaf: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    path = Path(path)
    train_files, test_files = leaf_files(path, Path(test) if test is not None else None)
    files = _read_split(train_files)
    pending: list[_Raw] = []  # the files read before they can be converted
    if kind == "auto":
        for raw in files:
            pending.append(raw)
            if raw:
                break
        if not any(pending):
            raise DataLayoutError(f"leaf: {path} has no user with training examples")
        kind = _detect(pending[-1])  # type: ignore[assignment]
    words: Sequence[str] = ()
    if kind == "words":
        if vocab is None:  # the training split's words, all of them read first (texts, not vectors)
            pending.extend(files)
            texts = (_text_of(i, u, p) for raw in pending for u, (x, _, p) in raw.items() for i in x)
            words = build_vocabulary(texts, vocab_size)
        elif isinstance(vocab, (str, Path)):
            words = read_vocabulary(Path(vocab), vocab_size)
        else:
            words = tuple(vocab)
    pending.reverse()
    train = _convert_all(_drain(pending), kind, words, max_words)
    train.update(_convert_all(files, kind, words, max_words))
    if not train:
        raise DataLayoutError(f"leaf: {path} has no user with training examples")
    test_clients = _convert_all(_read_split(test_files), kind, words, max_words)
    if test_files and not test_clients:  # cutting the training users instead would put test/ aside unsaid
        raise DataLayoutError(
            f"leaf: the test files ({', '.join(p.name for p in test_files[:3])}{', ...' if len(test_files) > 3 else ''} "
            f"in {test_files[0].parent}) hold no user with examples; write the test examples there, or leave the test "
            "files out to cut a test split from the training users (test_split=, test_fraction=)"
        )
    return with_test_split(
        train,
        test=test_clients or None,
        how=test_split,
        fraction=test_fraction,
        seed=seed,
        label="y",
        source=f"leaf:{path} ({kind})",
        vocabulary=tuple(LEAF_CHARACTERS if kind == "characters" else words),
    )
