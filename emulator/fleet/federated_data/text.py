"""Text to token ids, with vocabularies that are written down.

- Characters (LEAF's Shakespeare): LEAF's fixed set of 80 characters, ``LEAF_CHARACTERS`` (from
  LEAF's ``models/utils/language_utils.py``); a character's id is its position in the set, and any
  other character gets id 80 (``len(LEAF_CHARACTERS)``; LEAF itself would give -1, which no
  embedding takes), so a model over these ids needs 81 rows.
- Words (LEAF's Sent140, any text column): LEAF's tokenizer (``[\\w']+|[.,!?;]``, case kept), or
  the pieces between spaces (``split="space"``, as TFF splits StackOverflow's tokens), ids from a
  vocabulary list (position = id); unknown words get ``len(vocab)``, and a text is cut or padded to
  ``max_words`` ids with that same id, as LEAF's ``line_to_indices`` does. The vocabulary is a file
  (LEAF's ``embs.json`` with its ``vocab`` list, a JSON list, one word per line, GloVe's text file,
  or TFF's ``stackoverflow.word_count``/``tag_count`` cut to their ``vocab_size`` most frequent), or
  is built from the training split: the ``vocab_size`` most frequent words, ties in alphabetical order.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ._errors import DataLayoutError, DataSpecError

#: LEAF's Shakespeare character set (``ALL_LETTERS``): 80 characters, id = position.
LEAF_CHARACTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
#: The id of a character outside ``LEAF_CHARACTERS``.
UNKNOWN_CHARACTER = len(LEAF_CHARACTERS)
#: LEAF's Sent140 models read 25 words of a tweet.
LEAF_MAX_WORDS = 25
#: LEAF's Shakespeare examples are 80 characters, and the next one.
LEAF_WINDOW = 80
DEFAULT_VOCAB_SIZE = 10_000
Split = Literal["leaf", "space"]
SPLITS: tuple[str, ...] = ("leaf", "space")


def id_dtype(ids: int) -> np.dtype:
    """The smallest integer dtype holding the ids 0 to ``ids - 1``: uint8 up to 256 ids (LEAF's
    characters), uint16 up to 65,536 (a vocabulary of 10,000 words and its unknown id), else int32."""
    if ids <= 1 << 8:
        return np.dtype(np.uint8)
    if ids <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


#: The dtype of character ids: ``LEAF_CHARACTERS`` and the unknown id.
CHARACTER_DTYPE = id_dtype(UNKNOWN_CHARACTER + 1)
_CHAR_IDS = np.full(128, UNKNOWN_CHARACTER, dtype=CHARACTER_DTYPE)  # every LEAF character is ASCII
for _i, _c in enumerate(LEAF_CHARACTERS):
    _CHAR_IDS[ord(_c)] = _i
_WORDS = re.compile(r"[\w']+|[.,!?;]")


def encode_characters(text: str) -> np.ndarray:
    """Ids of ``text``'s characters in LEAF's 80-character set (others: ``UNKNOWN_CHARACTER``), as
    ``CHARACTER_DTYPE`` (uint8)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    out = np.full(len(codes), UNKNOWN_CHARACTER, dtype=CHARACTER_DTYPE)
    ascii_ = codes < 128
    out[ascii_] = _CHAR_IDS[codes[ascii_]]
    return out


def split_words(text: str, split: Split = "leaf") -> list[str]:
    """LEAF's tokenizer: runs of word characters and apostrophes, and the marks . , ! ? ; alone; or,
    with ``split="space"``, the text's pieces between spaces, as TFF splits StackOverflow's
    already tokenized ``tokens`` (``(``, ``c++`` and ``node.js`` are words there, not in LEAF's)."""
    return text.split() if split == "space" else _WORDS.findall(text)


def build_vocabulary(texts: Iterable[str], size: int = DEFAULT_VOCAB_SIZE) -> tuple[str, ...]:
    """The ``size`` most frequent words of ``texts``, most frequent first, ties alphabetical."""
    return most_frequent(count_words(texts), size)


def count_words(texts: Iterable[str], counts: Counter[str] | None = None, split: Split = "leaf") -> Counter[str]:
    """How often each word occurs in ``texts`` (added to ``counts``, when given)."""
    counts = Counter() if counts is None else counts
    counts.update(w for t in texts for w in split_words(t, split))
    return counts


def most_frequent(counts: Counter[str], size: int = DEFAULT_VOCAB_SIZE) -> tuple[str, ...]:
    """The ``size`` most frequent words, most frequent first, ties alphabetical."""
    if size < 1:
        raise DataSpecError(f"vocab_size must be at least 1, got {size}")
    return tuple(w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size])


def read_vocabulary(path: Path, size: int | None = None) -> tuple[str, ...]:
    """A vocabulary file: LEAF's ``embs.json`` (its ``vocab`` list), a JSON list, or one word a line,
    every word of it; or a file of counts, most frequent first, its first ``size`` words: TFF's
    ``stackoverflow.word_count`` (a word and its count a line) or ``stackoverflow.tag_count`` (a JSON
    object of counts), cut as TFF's ``load_word_counts(vocab_size)`` and its tag tasks cut them."""
    if not path.is_file():
        raise DataSpecError(f"vocabulary file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataLayoutError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); give a word list") from exc
        if _counts(data):
            return tuple(data)[:size]
        words = data.get("vocab") if isinstance(data, dict) else data
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise DataLayoutError(
                f"{path}: expected a JSON list of words, an object with a 'vocab' list (LEAF's embs.json) "
                "or an object of counts (TFF's stackoverflow.tag_count)"
            )
        return tuple(words)
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if lines and all(len(fields) == 2 and fields[1].isdigit() for fields in lines):  # stackoverflow.word_count
        return tuple(fields[0] for fields in lines)[:size]
    if lines and all(len(fields) > 1 and all(map(_is_number, fields[1:])) for fields in lines):
        return tuple(fields[0] for fields in lines)  # GloVe's text file: a word and its vector a line
    for number, fields in enumerate(lines, 1):
        if len(fields) > 1:  # a word never holds a space: no text would ever match this line
            raise DataLayoutError(
                f"{path}: line {number} holds {' '.join(fields[:3])!r}; a vocabulary file is one word a line, "
                "a word and its count a line (TFF's stackoverflow.word_count) or a word and its vector (GloVe's)"
            )
    return tuple(fields[0] for fields in lines)


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def _counts(data: object) -> bool:
    """A JSON object of word counts (TFF's ``stackoverflow.tag_count``), not LEAF's ``embs.json``."""
    return (
        isinstance(data, dict)
        and bool(data)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in data.values())
    )


def encode_words(
    texts: Sequence[str], vocab: Sequence[str], max_words: int = LEAF_MAX_WORDS, split: Split = "leaf"
) -> np.ndarray:
    """``[len(texts), max_words]`` ids, ``id_dtype(len(vocab) + 1)``; unknown words and padding are
    ``len(vocab)``."""
    if max_words < 1:
        raise DataSpecError(f"max_words must be at least 1, got {max_words}")
    index = _index(vocab) if isinstance(vocab, tuple) else {w: i for i, w in enumerate(vocab)}
    unknown = len(vocab)
    out = np.full((len(texts), max_words), unknown, dtype=id_dtype(unknown + 1))
    for row, text in enumerate(texts):
        ids = [index.get(w, unknown) for w in split_words(text, split)[:max_words]]
        out[row, : len(ids)] = ids
    return out


#: The last vocabularies' word -> id, found by identity: a cache keyed by the tuple hashed all of
#: it on every call (2.7 ms for LEAF's 400,000 GloVe words), once per user or client encoded.
_INDEXES: list[tuple[tuple[str, ...], dict[str, int]]] = []


def _index(vocab: tuple[str, ...]) -> dict[str, int]:
    """Word -> id of a vocabulary, built once for the clients it encodes one after another."""
    for known, index in _INDEXES:
        if known is vocab:
            return index
    index = {w: i for i, w in enumerate(vocab)}
    _INDEXES.insert(0, (vocab, index))
    del _INDEXES[4:]
    return index


@dataclass(frozen=True)
class WordIds:
    """Text features to read as word ids (``words=tokens+title`` in a data spec): ``max_words`` ids
    each (``encode_words``), from ``vocab`` (a file as ``read_vocabulary`` reads, or a list), else
    the training split's ``vocab_size`` most frequent words over those features."""

    features: tuple[str, ...]
    vocab: str | Path | Sequence[str] | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    max_words: int = LEAF_MAX_WORDS
    #: How a text is cut into words (``split_words``): LEAF's tokenizer, or at spaces as TFF does.
    split: Split = "leaf"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise DataSpecError(f"split must be {' or '.join(SPLITS)}, got {self.split!r}")

    def encode(
        self, train: dict[str, dict[str, np.ndarray]], test: dict[str, dict[str, np.ndarray]], where: str = ""
    ) -> tuple[str, ...]:
        """The features replaced, in place, in every client of both splits; the vocabulary."""
        first = next(iter(train.values()), {})
        self.check({name: "str" if a.dtype == object else str(a.dtype) for name, a in first.items()}, where)
        words = self.vocabulary(
            lambda: count_words(
                (str(t) for ex in train.values() for n in self.features for t in ex[n].ravel()), split=self.split
            )
        )
        for clients in (train, test):
            for examples in clients.values():
                self.encode_examples(examples, words, where)
        return words

    def check(self, features: Mapping[str, str], where: str = "") -> None:
        """The features named are text features (``features``: name -> dtype name, ``str`` for text)."""
        for name in self.features:
            if name not in features:
                raise DataSpecError(
                    f"{where}words={name}: no such feature; the features are {', '.join(sorted(features))}"
                )
            if features[name] != "str":
                raise DataSpecError(f"{where}words={name}: feature {name!r} is {features[name]}, not text")

    def vocabulary(self, counts: Callable[[], Counter[str]]) -> tuple[str, ...]:
        """The words: ``vocab``'s, or the ``vocab_size`` most frequent of ``counts()`` (the words of
        the training split's texts of the features, counted only when the vocabulary is built from them)."""
        if self.vocab is None:
            return most_frequent(counts(), self.vocab_size)
        if isinstance(self.vocab, (str, Path)):
            return read_vocabulary(Path(self.vocab), self.vocab_size)
        return tuple(self.vocab)

    def encode_examples(self, examples: dict[str, np.ndarray], words: Sequence[str], where: str = "") -> None:
        """One client's features replaced, in place, by their word ids."""
        for name in self.features:
            texts = examples[name]
            if texts.ndim != 1:
                raise DataLayoutError(f"{where}words={name}: feature {name!r} holds more than one text per example")
            examples[name] = encode_words([str(t) for t in texts], words, self.max_words, self.split)


@dataclass(frozen=True)
class CharWindows:
    """A text feature cut as LEAF cuts Shakespeare (``chars=snippets`` in a data spec, for TFF's
    Shakespeare, whose ``snippets`` are a role's lines as byte strings): a client's texts joined by
    line ends, each ``window`` characters (80, LEAF's) from every ``step``-th (1, LEAF's) an example
    ``x`` with the character after them its label ``y``, both ids in ``LEAF_CHARACTERS`` (uint8, as
    ``load_leaf`` reads LEAF's own Shakespeare). A client of no more than ``window`` characters has
    no example; the client's other features are left out, as they are not per window."""

    feature: str
    window: int = LEAF_WINDOW
    step: int = 1

    def cut(self, clients: Mapping[str, Mapping[str, np.ndarray]], where: str = "") -> dict[str, dict[str, np.ndarray]]:
        """Each client's windows and next characters, as ``x`` and ``y``."""
        for name, value in (("window", self.window), ("step", self.step)):
            if value < 1:
                raise DataSpecError(f"{where}{name} must be at least 1, got {value}")
        out: dict[str, dict[str, np.ndarray]] = {}
        for client, examples in clients.items():
            if self.feature not in examples:
                raise DataSpecError(
                    f"{where}chars={self.feature}: no such feature; the features are {', '.join(sorted(examples))}"
                )
            texts = examples[self.feature]
            if texts.dtype != object:
                raise DataSpecError(f"{where}chars={self.feature}: feature {self.feature!r} is {texts.dtype}, not text")
            ids = encode_characters("\n".join(str(t) for t in texts.ravel()))
            starts = np.arange(0, len(ids) - self.window, self.step)
            if len(starts):
                out[client] = {"x": ids[starts[:, None] + np.arange(self.window)], "y": ids[starts + self.window]}
        return out
