"""LEAF's JSON layout: train/ and test/ folders, FEMNIST vectors, Shakespeare characters, Sent140 words,
and the files LEAF's tools would never write (malformed JSON, counts that disagree, ragged x)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from emulator.fleet.federated_data import (
    LEAF_CHARACTERS,
    DataLayoutError,
    DataSpecError,
    load_leaf,
)


def write_leaf(path: Path, users: dict[str, tuple[list[Any], list[Any]]], **extra: Any) -> Path:
    """One LEAF file as LEAF's scripts write it: users, num_samples and user_data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
        **extra,
    }
    path.write_text(json.dumps(data))
    return path


def femnist_users(rng: np.random.Generator, names: list[str], n: int = 3) -> dict[str, tuple[list[Any], list[Any]]]:
    return {u: (rng.random((n, 784)).round(3).tolist(), rng.integers(0, 62, n).tolist()) for u in names}


def test_femnist_train_and_test_folders_become_vectors_with_the_files_test_split(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    write_leaf(tmp_path / "train" / "all_data_0_train_9.json", femnist_users(rng, ["f0001", "f0002"]))
    write_leaf(tmp_path / "train" / "all_data_1_train_9.json", femnist_users(rng, ["f0003"]))
    write_leaf(tmp_path / "test" / "all_data_0_test_9.json", femnist_users(rng, ["f0001", "f0002", "f0003"], n=1))
    data = load_leaf(tmp_path)
    assert data.client_ids == ("f0001", "f0002", "f0003")
    assert data.test_split == "files" and data.test_client_ids == data.client_ids
    assert data.features["x"].dtype == "float32" and data.features["x"].shape == (784,)
    assert data.features["y"].dtype == "int64" and data.features["y"].shape == ()
    assert data.sizes() == {"f0001": 3, "f0002": 3, "f0003": 3} and data.num_examples("test") == 3
    assert data.label == "y"


def test_shakespeare_windows_become_ids_in_leafs_80_characters(tmp_path: Path) -> None:
    text = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer~"
    windows = [text[i : i + 80] for i in range(5)]
    nexts = [text[i + 80] for i in range(5)]
    write_leaf(
        tmp_path / "shakespeare.json", {"THE_TRAGEDY_OF_HAMLET_HAMLET": (windows, nexts)}, hierarchies=["HAMLET"]
    )
    data = load_leaf(tmp_path / "shakespeare.json", test_fraction=0.4)
    assert data.source.endswith("(characters)") and data.vocabulary == tuple(LEAF_CHARACTERS)
    x = np.concatenate(
        [data.examples("THE_TRAGEDY_OF_HAMLET_HAMLET")["x"], data.test["THE_TRAGEDY_OF_HAMLET_HAMLET"]["x"]]
    )
    assert x.shape == (5, 80) and x.dtype == np.uint8
    decoded = {"".join(LEAF_CHARACTERS[i] if i < 80 else "?" for i in row) for row in x}
    assert decoded == {w.replace("~", "?") for w in windows}
    assert len(LEAF_CHARACTERS) == 80


def test_sent140_rows_become_word_ids_padded_with_the_unknown_id(tmp_path: Path) -> None:
    rows = [
        ["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "alice", "I love this, I love it!"],
        ["1467810672", "Mon Apr 06 22:19:49 PDT 2009", "NO_QUERY", "alice", "sad day"],
    ]
    write_leaf(tmp_path / "train" / "a.json", {"alice": (rows, [1, 0])})
    write_leaf(tmp_path / "test" / "a.json", {"alice": (rows[:1], [1])})
    data = load_leaf(tmp_path, max_words=6)
    vocab = data.vocabulary
    assert vocab[:2] == ("I", "love")  # most frequent first, ties alphabetical
    x = data.examples("alice")["x"]
    unknown = len(vocab)
    assert x.shape == (2, 6)
    assert [vocab[i] for i in x[0]] == ["I", "love", "this", ",", "I", "love"]
    assert list(x[1][2:]) == [unknown] * 4
    assert list(data.examples("alice")["y"]) == [1, 0]


def test_a_given_vocabulary_file_fixes_the_ids(tmp_path: Path) -> None:
    write_leaf(tmp_path / "t.json", {"u": (["good movie", "bad"], [1, 0])})
    (tmp_path / "embs.json").write_text(json.dumps({"vocab": ["bad", "good"], "emba": [[0.0], [1.0]]}))
    data = load_leaf(tmp_path / "t.json", vocab=tmp_path / "embs.json", max_words=2, test_fraction=0.5)
    x = np.concatenate([data.train["u"]["x"], data.test["u"]["x"]]) if data.test else data.train["u"]["x"]
    assert sorted(map(tuple, x.tolist())) == [(0, 2), (1, 2)]


def test_sent140_with_leafs_glove_vocabulary_encodes_each_user_without_rehashing_it(tmp_path: Path) -> None:
    """LEAF's embs.json holds GloVe's 400,000 words: the vocabulary, a tuple hashed in full to find
    its index on every user's call (2.7 ms), made 20,000 users load in 50 s instead of 1.9 s."""
    import time

    words = [f"w{i}" for i in range(400_000)]
    (tmp_path / "embs.json").write_text(json.dumps({"vocab": words, "emba": []}))
    row = ["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY"]
    users = {f"u{i}": ([[*row, f"u{i}", f"w{i} w{i + 1} unknown"]] * 2, [0, 1]) for i in range(2000)}
    write_leaf(tmp_path / "train" / "all_data.json", users)
    start = time.process_time()
    data = load_leaf(tmp_path, vocab=tmp_path / "embs.json", max_words=4)
    assert time.process_time() - start < 1.2  # 3 s and more when each user hashed the whole vocabulary
    assert data.vocabulary[:2] == ("w0", "w1") and len(data) == 2000
    assert data.train["u7"]["x"].tolist() == [[7, 8, 400_000, 400_000]]  # unknown and padding: len(vocab)


def test_users_in_user_data_without_examples_are_skipped_as_leafs_by_sample_split_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            {
                "users": ["a"],
                "num_samples": [2],
                "user_data": {"a": {"x": [[1.0], [2.0]], "y": [0, 1]}, "gone": {"x": [], "y": []}},
            }
        )
    )
    assert load_leaf(path).client_ids == ("a",)


def test_without_test_files_users_can_be_held_out_whole(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    write_leaf(tmp_path / "all.json", femnist_users(rng, [f"w{i}" for i in range(10)]))
    data = load_leaf(tmp_path / "all.json", test_split="clients", test_fraction=0.3, seed=4)
    assert data.test_split == "clients" and len(data.test) == 3 and len(data) == 7
    assert not set(data.test) & set(data.train)
    again = load_leaf(tmp_path / "all.json", test_split="clients", test_fraction=0.3, seed=4)
    assert again.test_client_ids == data.test_client_ids


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"users": ["a"], ', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"users": ["a"], "num_samples": [1]}), "no 'user_data' key"),
        (
            json.dumps({"users": ["a"], "num_samples": [3], "user_data": {"a": {"x": [[1.0]], "y": [0]}}}),
            "num_samples says",
        ),
        (
            json.dumps({"users": ["a"], "num_samples": [1, 2], "user_data": {"a": {"x": [[1.0]], "y": [0]}}}),
            "one count per user",
        ),
        (json.dumps({"users": ["a"], "user_data": {"a": {"x": [[1.0], [2.0]], "y": [0]}}}), "2 x but 1 y"),
        (json.dumps({"users": ["a", "b"], "user_data": {"a": {"x": [[1.0]], "y": [0]}}}), "'b' is listed"),
        (
            json.dumps({"users": ["a"], "user_data": {"a": {"x": [[1.0, 2.0], [3.0]], "y": [0, 1]}}}),
            "different lengths",
        ),
        (json.dumps({"users": [], "user_data": {"z": {"x": [[1.0]], "y": [0]}}}), "does not list"),
        (  # JSON's keys are strings: user 7 and user "7" are one user_data entry
            json.dumps({"users": [7, "7"], "num_samples": [1, 1], "user_data": {"7": {"x": [[1.0]], "y": [0]}}}),
            r"'users' lists '7' twice \(a JSON number and a string are one user id\)",
        ),
        *(
            (
                json.dumps({"users": ["a"], "user_data": {"a": {"x": [[1.0, v]], "y": [0]}}}),
                "NaN, infinite or past float32",
            )
            for v in (float("nan"), float("inf"), -1e39, 10**400)  # 10**400: OverflowError, 1e39: float32's inf
        ),
        *(  # a NaN label was a float32 class that every device trained on; 10**20 and 1e400 the same
            (json.dumps({"users": ["a"], "user_data": {"a": {"x": [[1.0]], "y": [v]}}}), "a y that is NaN, infinite")
            for v in (float("nan"), float("inf"), 10**20)
        ),
        pytest.param(  # Python's json refuses to convert an integer of over 4,300 digits: a ValueError traceback
            '{"users": ["a"], "user_data": {"a": {"x": [[1' + "0" * 5000 + ']], "y": [0]}}}',
            "an integer of thousands of digits",
            id="5000-digit-integer",
        ),
        pytest.param(  # a RecursionError traceback
            '{"users": ["a"], "user_data": {"a": {"x": ' + "[" * 100_000 + "]" * 100_000,
            "nested thousands deep",
            id="lists-nested-100000-deep",
        ),
        (  # a count given as text was said to differ from itself ("has 4 examples but user_data holds 4")
            json.dumps({"users": ["a"], "num_samples": ["1"], "user_data": {"a": {"x": [[1.0]], "y": [0]}}}),
            "num_samples gives user 'a' '1' examples; a count is a JSON number",
        ),
        (  # LEAF's CelebA: file names of images kept elsewhere, which were read as a text's words
            json.dumps({"users": ["a"], "user_data": {"a": {"x": ["000001.jpg"], "y": [1]}}}),
            "x holds image file names",
        ),
        (  # LEAF's Reddit: y is an object of target tokens
            json.dumps({"users": ["a"], "user_data": {"a": {"x": [[["hi"]]], "y": [{"target_tokens": [["hi"]]}]}}}),
            r"y holds objects \(target_tokens, as LEAF's Reddit writes them\)",
        ),
    ],
)
def test_hostile_leaf_files_get_one_line_errors_that_name_the_problem(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DataLayoutError, match=message) as info:
        load_leaf(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_clients_whose_vectors_differ_in_length_are_refused(tmp_path: Path) -> None:
    write_leaf(tmp_path / "t.json", {"a": ([[1.0, 2.0]], [0]), "b": ([[1.0, 2.0, 3.0]], [1])})
    with pytest.raises(DataLayoutError, match="feature 'x'"):
        load_leaf(tmp_path / "t.json", test_fraction=0.5)


def test_users_listed_as_json_numbers_are_the_string_keys_of_user_data(tmp_path: Path) -> None:
    """LEAF's synthetic data numbers its users; json.dump writes user_data's keys as strings."""
    users = {i: {"x": [[0.5] * 3] * 2, "y": [i % 2, 1]} for i in range(3)}
    (tmp_path / "synthetic.json").write_text(
        json.dumps({"users": list(users), "num_samples": [2] * 3, "user_data": users})
    )
    data = load_leaf(tmp_path / "synthetic.json", test_split="clients", test_fraction=0.34)
    assert sorted(data.client_ids + data.test_client_ids) == ["0", "1", "2"] and data.features["x"].shape == (3,)


def test_a_user_in_two_files_of_one_split_is_refused(tmp_path: Path) -> None:
    write_leaf(tmp_path / "a.json", {"u": ([[1.0]], [0])})
    write_leaf(tmp_path / "b.json", {"u": ([[2.0]], [1])})
    with pytest.raises(DataLayoutError, match="also appears in"):
        load_leaf(tmp_path)


def test_a_missing_path_or_an_empty_folder_says_what_a_leaf_dataset_is(tmp_path: Path) -> None:
    with pytest.raises(DataSpecError, match="does not exist"):
        load_leaf(tmp_path / "nope")
    with pytest.raises(DataLayoutError, match="train/ and test/"):
        load_leaf(tmp_path)


def test_a_path_that_is_neither_a_file_nor_a_folder_is_refused_unread(tmp_path: Path) -> None:
    """A pipe or a device (/dev/zero would be read for ever) was a NotADirectoryError."""
    import os

    fifo = tmp_path / "data.json"
    os.mkfifo(fifo)  # opened for reading, it would wait for a writer
    with pytest.raises(DataSpecError, match=r"data\.json is neither a file nor a folder"):
        load_leaf(fifo)
    with pytest.raises(DataSpecError, match="is neither a file nor a folder"):
        load_leaf("/dev/zero")


def test_each_file_is_converted_before_the_next_is_read(tmp_path: Path) -> None:
    """FEMNIST's train/ holds 36 files of JSON floats (36 bytes each as Python objects): all of them
    read before any was converted took many times the memory of one. Peak memory of the load, as
    tracemalloc counts Python's objects and numpy's arrays: under half of one file's JSON as Python
    objects beyond the dataset's arrays (and the copies its test split is cut into), as each user's
    x becomes an array while the file is parsed (a whole file's floats as objects: 1.3 times that)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    for part in range(6):
        write_leaf(
            tmp_path / "train" / f"all_data_{part}.json", femnist_users(rng, [f"f{part}_{u}" for u in range(6)], n=8)
        )
    tracemalloc.start()
    try:
        json.loads((tmp_path / "train" / "all_data_0.json").read_text())
        _, one_file = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        data = load_leaf(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    arrays = sum(a.nbytes for split in (data.train, data.test) for ex in split.values() for a in ex.values())
    assert len(data) == 36 and peak < 0.5 * one_file + 2 * arrays  # all six files at once: over 6 * one_file


def test_a_file_that_does_not_start_as_json_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    """2 GB of zeros named .json was parsed whole (10 s, 4 GB of memory) to say it was not JSON."""
    import os
    import tracemalloc

    zeros = tmp_path / "zeros.json"
    with zeros.open("wb") as f:
        os.truncate(f.fileno(), 64 * 2**20)  # sparse: no disk written
    tracemalloc.start()
    try:
        with pytest.raises(DataLayoutError, match=r"zeros\.json: not a LEAF file: it starts with \\x00.*give LEAF's"):
            load_leaf(zeros)
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()
    data = {"users": ["a"], "num_samples": [2], "user_data": {"a": {"x": [[1.0], [2.0]], "y": [0, 1]}}}
    text = json.dumps(data)
    (tmp_path / "cut.json").write_text(text[: len(text) - 9])
    with pytest.raises(DataLayoutError, match=r"cut\.json: not valid JSON .*ends in the middle of its data"):
        load_leaf(tmp_path / "cut.json")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + text.encode())  # what PowerShell and Notepad write
    assert load_leaf(tmp_path / "bom.json").client_ids == ("a",)


def test_a_folder_file_that_is_a_broken_link_is_named_not_skipped(tmp_path: Path) -> None:
    """A split of links (a cluster's shared data) whose target moved lost those users' examples unsaid."""
    write_leaf(tmp_path / "train" / "all_data_0.json", {"a": ([[1.0], [2.0]], [0, 1])})
    (tmp_path / "train" / "all_data_1.json").symlink_to(tmp_path / "moved" / "all_data_1.json")
    with pytest.raises(DataSpecError, match=r"all_data_1\.json is a symbolic link to .*moved/all_data_1\.json, which"):
        load_leaf(tmp_path)


def test_a_test_folder_of_no_examples_is_refused_not_replaced_by_a_cut_of_training_users(tmp_path: Path) -> None:
    """Its users all empty, test/ was put aside unsaid and a tenth of each training user cut instead."""
    write_leaf(tmp_path / "train" / "a.json", {"u1": ([[1.0]] * 3, [0, 1, 0]), "u2": ([[1.0]] * 3, [1, 0, 1])})
    write_leaf(tmp_path / "test" / "a.json", {"u1": ([], [])})
    with pytest.raises(DataLayoutError, match=r"the test files \(a\.json in .*test\) hold no user with examples"):
        load_leaf(tmp_path)
