"""``FORMAT:PATH[,options]``: what --data will take, and a one-line error for each way it can be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from emulator.fleet.federated_data import DataLayoutError, DataSpecError, load_data, parse_data_spec


def test_a_spec_parses_to_its_format_path_and_options(tmp_path: Path) -> None:
    (tmp_path / "data.parquet").write_bytes(b"")
    spec = parse_data_spec("table:data.parquet,client=user_id,test_fraction=0.25", base_dir=tmp_path)
    assert spec.format == "table" and spec.path == tmp_path / "data.parquet"
    assert dict(spec.options) == {"client": "user_id", "test_fraction": "0.25"}
    assert str(spec) == f"table:{tmp_path / 'data.parquet'},client=user_id,test_fraction=0.25"
    assert parse_data_spec("digits").path is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty data spec"),
        ("csv:data.csv", "unknown data format 'csv'.*path: table:data.csv,client=COLUMN"),
        ("data.csv", "unknown data format 'data.csv'.*path: table:data.csv,client=COLUMN"),
        ("users/part-0.parquet", "path: table:users/part-0.parquet,client=COLUMN"),
        ("all_data_0.json", "path: leaf:all_data_0.json"),
        ("fed_emnist_train.h5", "path: tff-h5:fed_emnist_train.h5"),
        ("mnist.npz", "path: npz:mnist.npz"),
        ("femnist", "unknown data format 'femnist' in .*use one of leaf"),
        ("digit", r"unknown data format 'digit' \(did you mean digits\?\)"),
        ("lef:present.csv", r"unknown data format 'lef' \(did you mean leaf\?\)"),
        ("leaf:missing", "leaf: .*missing does not exist"),
        ("leaf", "give a path"),
        ("table:present.csv", "name the client-id column"),
        ("leaf:present.csv,colour=red", "unknown option 'colour'; leaf takes"),
        ("digits,partiton=iid", r"unknown option 'partiton' \(did you mean partition\?\); digits takes"),
        ("leaf:present.csv,vocab_size=big", "is not a whole number"),
        ("digits,alpha=nan", "must be finite"),
        ("digits,partition=zipf", "partition='zipf' is unknown"),
        ("digits:somewhere", "digits takes no path"),
        ("leaf:present.csv,test=gone", "test=.*gone does not exist"),
        ("leaf:present.csv,seed", "is not KEY=VALUE"),
        ("leaf:present.csv,test_split=none", "test_split='none' is unknown"),
        ("digits,rename=y", "'y' is not OLD:NEW; write rename=label:y"),
        ("digits,rename=y:label+y:z", "rename names 'y' twice"),
    ],
)
def test_bad_specs_get_one_line_errors_naming_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "present.csv").write_text("c,x\n1,2\n")
    with pytest.raises(DataSpecError, match=message) as info:
        parse_data_spec(text, base_dir=tmp_path)
    assert "\n" not in str(info.value)


def test_digits_cut_by_a_partitioner_is_the_same_for_the_same_seed() -> None:
    a = load_data("digits,partition=shards,clients=20,shards=2", seed=3)
    b = load_data("digits,partition=shards,clients=20,shards=2", seed=3)
    c = load_data("digits,partition=shards,clients=20,shards=2", seed=4)
    assert len(a) == 20 and a.num_examples("train") + a.num_examples("test") == 1797
    assert all(np.array_equal(a.train[k]["y"], b.train[k]["y"]) for k in a.client_ids)
    assert any(not np.array_equal(a.train[k]["y"], c.train[k]["y"]) for k in a.client_ids)


def test_an_npz_with_a_test_split_keeps_it_central(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.random((60, 2)), rng.integers(0, 3, 60)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=rng.random((9, 2)), y_test=np.zeros(9, int))
    data = load_data(f"npz:{tmp_path / 'd.npz'},partition=dirichlet,alpha=1,clients=4,min_size=2")
    assert data.test_client_ids == ("central",) and data.num_examples("test") == 9 and data.num_examples() == 60


def test_an_npz_in_keras_layout_trains_on_x_train_and_tests_on_x_test(tmp_path: Path) -> None:
    """Keras' mnist.npz holds x_train, y_train, x_test and y_test (uint8 images); it was refused for want of x."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 4, 4), dtype=np.uint8)
    np.savez(
        tmp_path / "mnist.npz", x_train=images, y_train=np.arange(40) % 4, x_test=images[:6], y_test=np.zeros(6, int)
    )
    data = load_data(f"npz:{tmp_path / 'mnist.npz'},clients=4")
    assert data.num_examples() == 40 and data.test_client_ids == ("central",) and data.features["x"].dtype == "uint8"


def test_an_npz_in_keras_cifar_layout_reads_its_n_by_1_labels_as_class_ids(tmp_path: Path) -> None:
    """Keras' cifar10 arrays hold y_train as [N, 1]: shards sorted that one column, and every shard
    was one example repeated (a client of 25 copies of one image)."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, (100, 1)).astype(np.uint8)
    np.savez(
        tmp_path / "cifar.npz", x_train=np.arange(100)[:, None], y_train=y, x_test=np.zeros((4, 1), int), y_test=y[:4]
    )
    data = load_data(f"npz:{tmp_path / 'cifar.npz'},partition=shards,clients=4")
    assert data.features["y"].shape == () and data.central_test()["y"].shape == (4,)
    every = np.concatenate([data.train[c]["x"][:, 0] for c in data.client_ids])
    assert sorted(every.tolist()) == list(range(100))  # each example once (the test split: x_test)
    assert all(len(np.unique(data.train[c]["y"])) < 5 for c in data.client_ids)  # two shards: not every class


def test_an_npz_with_nan_values_is_refused_naming_the_array(tmp_path: Path) -> None:
    np.savez(tmp_path / "nan.npz", x=np.array([[0.5, np.nan], [0.1, 0.2]]), y=np.array([0, 1]))
    with pytest.raises(DataLayoutError, match=r"array 'x' holds values that are NaN, infinite .* first in example 0"):
        load_data(f"npz:{tmp_path / 'nan.npz'},clients=2")


def test_an_npz_spec_naming_a_single_array_or_no_arrays_is_refused_saying_what_to_save(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((4, 2)))  # np.save's one unnamed array
    with pytest.raises(DataLayoutError, match=r"is one array \(a \.npy file\); save x and y with np\.savez"):
        load_data(f"npz:{tmp_path / 'x.npy'}")
    np.savez(tmp_path / "a.npz", a=np.zeros(3))
    with pytest.raises(DataLayoutError, match=r"has no array 'x' \(arrays: a\)"):
        load_data(f"npz:{tmp_path / 'a.npz'}")


def test_an_npz_array_that_needs_unpickling_or_more_than_memory_is_refused_naming_it(tmp_path: Path) -> None:
    """An object array was numpy's ValueError, and an .npy header declaring 10**12 floats a MemoryError."""
    import io
    import zipfile

    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}, None], dtype=object), y=np.array([1, 2]))
    with pytest.raises(DataLayoutError, match=r"array 'x' cannot be read without running pickled code"):
        load_data(f"npz:{tmp_path / 'objects.npz'}")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)})
    labels = io.BytesIO()
    np.save(labels, np.arange(3))
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as archive:
        archive.writestr("x.npy", header.getvalue())
        archive.writestr("y.npy", labels.getvalue())
    with pytest.raises(DataLayoutError, match=r"array 'x' is declared float32\[1000000, 1000000\], 3725 GiB"):
        load_data(f"npz:{tmp_path / 'huge.npz'}")
    with pytest.raises(DataLayoutError, match=r"reads as a pickle, which is never loaded\)$"):
        load_data("npz:/dev/zero")


def test_rename_names_features_and_the_label_as_the_plan_reads_them(tmp_path: Path) -> None:
    """A table's ``pixels`` and text ``label`` become ``x`` and ``y``; the label's class names stay."""
    csv = tmp_path / "t.csv"
    csv.write_text("user,pixels,label\nu1,0.5,cat\nu1,0.25,dog\nu2,1.0,cat\nu2,0.75,cat\n")
    data = load_data(
        f"table:{csv},client=user,label=label,rename=pixels:x+label:y,test_split=clients,test_fraction=0.5"
    )
    assert sorted(data.features) == ["x", "y"] and data.label == "y" and data.label_names == ("cat", "dog")
    plain = load_data(f"table:{csv},client=user,label=label,test_split=clients,test_fraction=0.5")
    for split in ("train", "test"):
        for client in getattr(plain, split):
            ours, theirs = data.examples(client, split), plain.examples(client, split)  # type: ignore[arg-type]
            assert np.array_equal(ours["x"], theirs["pixels"]) and np.array_equal(ours["y"], theirs["label"])
    with pytest.raises(DataLayoutError, match="'colour' is not a feature of table:.*; its features are label, pixels"):
        load_data(f"table:{csv},client=user,rename=colour:x")
    with pytest.raises(DataLayoutError, match="'pixels' would name two features"):
        load_data(f"table:{csv},client=user,rename=label:pixels")
    swapped = load_data(f"table:{csv},client=user,label=label,rename=label:pixels+pixels:label")
    assert swapped.features["pixels"].dtype == "int64" and swapped.label == "pixels"


def test_test_split_options_beside_the_files_own_test_split_are_refused_not_ignored(tmp_path: Path) -> None:
    """A LEAF folder's test/ (by sample), or an npz's x_test, is the test split: test_split=clients
    (LEAF's by-user split) or test_fraction= beside it were silently ignored."""
    for split, users in (("train", ["a", "b", "c"]), ("test", ["a", "b", "c"])):
        (tmp_path / "leaf" / split).mkdir(parents=True)
        data = {u: {"x": [[0.5, 0.5]] * 2, "y": [0, 1]} for u in users}
        (tmp_path / "leaf" / split / "d.json").write_text(
            json.dumps({"users": users, "num_samples": [2] * 3, "user_data": data})
        )
    with pytest.raises(DataSpecError, match=r"test_split=clients would cut .* brings its own \(its test/ folder\)"):
        load_data(f"leaf:{tmp_path / 'leaf'},test_split=clients")
    assert load_data(f"leaf:{tmp_path / 'leaf' / 'train'},test_split=clients").test_split == "clients"
    x, y = np.zeros((20, 2)), np.arange(20) % 2
    np.savez(tmp_path / "k.npz", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
    with pytest.raises(DataSpecError, match=r"test_fraction=0.5 would cut .*\(x_test and y_test\)"):
        load_data(f"npz:{tmp_path / 'k.npz'},partition=iid,clients=2,test_fraction=0.5")


def test_a_path_holding_commas_or_colons_is_read_when_it_exists(tmp_path: Path) -> None:
    """A comma parts a spec's options, so ``runs/c,d`` was option ``d`` and no path could hold one."""
    folder = tmp_path / "exports, 2024:q1"
    folder.mkdir()
    leaf = {"users": ["a"], "num_samples": [2], "user_data": {"a": {"x": [[1.0], [2.0]], "y": [0, 1]}}}
    (folder / "all.json").write_text(json.dumps(leaf))
    spec = parse_data_spec(f"leaf:{folder}/all.json,seed=3,test_split=examples")
    assert spec.path == folder / "all.json" and dict(spec.options) == {"seed": "3", "test_split": "examples"}
    assert parse_data_spec(str(spec)) == spec  # as a fleet config's [data] is turned back into a spec
    assert load_data(f"leaf:{folder}").client_ids == ("a",)
    with pytest.raises(DataSpecError, match=r"option 'q2' is not KEY=VALUE; .* only when the path with it exists"):
        parse_data_spec(f"leaf:{tmp_path}/exports,q2")


def test_a_link_that_loops_or_points_nowhere_says_which(tmp_path: Path) -> None:
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    (tmp_path / "gone.h5").symlink_to(tmp_path / "moved.h5")
    with pytest.raises(DataSpecError, match=r"loop\.json cannot be opened \(.*a symbolic link that loops\)"):
        parse_data_spec(f"leaf:{tmp_path / 'loop.json'}")
    with pytest.raises(DataSpecError, match=r"gone\.h5 is a symbolic link to .*moved\.h5, which does not exist"):
        parse_data_spec(f"tff-h5:{tmp_path / 'gone.h5'}")


def test_an_npz_cut_short_or_damaged_is_one_line_saying_to_copy_it_again(tmp_path: Path) -> None:
    """A cut .npz was zipfile's BadZipFile traceback; a header with bytes overwritten was called a pickle."""
    np.savez(tmp_path / "whole.npz", x=np.ones((20, 4)), y=np.arange(20))
    whole = (tmp_path / "whole.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataLayoutError, match=r"cut\.npz is not a whole \.npz file .*; copy or save it again$"):
        load_data(f"npz:{tmp_path / 'cut.npz'}")
    damaged = bytearray(whole)
    start = whole.index(b"{'descr'")
    damaged[start + 20 : start + 40] = b"\xff" * 20
    (tmp_path / "damaged.npz").write_bytes(bytes(damaged))
    with pytest.raises(DataLayoutError, match=r"array 'x' is (damaged|not).*"):
        load_data(f"npz:{tmp_path / 'damaged.npz'}")


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("all.json", "leaf:{}"),
        ("t.parquet", "table:{},client=user"),
        ("t.csv", "table:{},client=user"),
        ("t.h5", "tff-h5:{}"),
        ("t.npz", "npz:{}"),
        ("leaf/all.json", "leaf:{}"),
    ],
)
def test_a_file_this_user_may_not_read_is_one_line_naming_it(tmp_path: Path, name: str, spec: str) -> None:
    """A LEAF file was a PermissionError traceback; a Parquet, CSV or HDF5 file "not a Parquet file"."""
    import os

    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"")
    path.chmod(0)
    if os.access(path, os.R_OK):
        pytest.skip("this user reads every file (root)")
    target = path.parent if name.startswith("leaf/") else path
    with pytest.raises(DataSpecError, match=rf"{path.name} cannot be read: permission denied; .*chmod a\+r "):
        load_data(spec.format(target))


def test_an_empty_npz_or_one_of_no_examples_or_single_values_is_one_line_saying_what_to_save(tmp_path: Path) -> None:
    """A file of no bytes was numpy's EOFError traceback, a 0-d array (np.savez(x=3.0)) a TypeError
    traceback from len(), and an x of no rows "use at most 0 clients"."""
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(DataLayoutError, match=r"empty\.npz is empty \(0 bytes\); save x and y with np\.savez"):
        load_data(f"npz:{tmp_path / 'empty.npz'}")
    np.savez(tmp_path / "none.npz", x=np.zeros((0, 4)), y=np.zeros(0, dtype=np.int64))
    with pytest.raises(DataLayoutError, match=r"none\.npz: array 'x' holds no example; save the examples"):
        load_data(f"npz:{tmp_path / 'none.npz'}")
    for key in ("x", "y", "x_test", "y_test"):
        arrays = {"x": np.zeros((6, 2)), "y": np.arange(6) % 2, "x_test": np.zeros((2, 2)), "y_test": np.arange(2)}
        arrays[key] = np.float64(3.0) if key.startswith("x") else np.int64(1)
        np.savez(tmp_path / f"{key}.npz", **arrays)
        with pytest.raises(DataLayoutError, match=rf"array '{key}' is a single value \(shape \(\)\), not one per"):
            load_data(f"npz:{tmp_path / key}.npz,clients=2")


def test_an_npz_x_test_of_no_examples_is_refused(tmp_path: Path) -> None:
    """The central test set was dropped and the run measured no accuracy, unsaid."""
    np.savez(tmp_path / "d.npz", x=np.ones((10, 2)), y=np.arange(10) % 2, x_test=np.ones((0, 2)), y_test=np.zeros(0))
    with pytest.raises(DataLayoutError, match=r"d\.npz,clients=2: its test split holds no example"):
        load_data(f"npz:{tmp_path / 'd.npz'},clients=2")
