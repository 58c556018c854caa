"""Tables with a client column: Parquet, CSV and a datasets folder written by save_to_disk."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from emulator.fleet.federated_data import (
    DataLayoutError,
    DataSpecError,
    FeatureSpec,
    FederatedDataError,
    FederatedDataset,
    load_data,
    load_table,
)


def rows() -> dict[str, list[object]]:
    return {
        "user_id": ["u2", "u1", "u2", "u1", "u3"],
        "pixels": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8], [0.9, 1.0]],
        "text": ["a", "b", "c", "d", "e"],
        "label": [1, 0, 1, 0, 2],
    }


def test_parquet_rows_group_by_client_in_their_order(tmp_path: Path) -> None:
    pq.write_table(pa.table(rows()), tmp_path / "data.parquet")
    data = load_table(tmp_path / "data.parquet", client="user_id", test_split="clients", test_fraction=0.34)
    everything = {**data.train, **data.test}
    assert sorted(everything) == ["u1", "u2", "u3"] and data.label == "label"
    assert list(everything["u2"]["text"]) == ["a", "c"]
    assert np.allclose(everything["u1"]["pixels"], [[0.3, 0.4], [0.7, 0.8]])
    assert data.features["pixels"].shape == (2,) and data.features["text"].dtype == "str"


def test_csv_client_ids_stay_text(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("writer,x,y\n007,0.5,1\n7,0.25,0\n007,1.5,1\n")
    test = tmp_path / "test.csv"
    test.write_text("writer,x,y\n007,0.0,1\n")
    data = load_data(f"table:{path},client=writer,test={test}")
    assert data.client_ids == ("007", "7") and data.label == "y" and data.test_client_ids == ("007",)
    assert list(data.examples("007")["x"]) == [0.5, 1.5]


def test_a_csv_row_with_an_empty_client_id_is_refused_as_a_missing_one(tmp_path: Path) -> None:
    """A null id was refused, but a CSV's empty cell is text: its rows became the examples of client ''."""
    path = tmp_path / "data.csv"
    path.write_text("writer,x,y\n007,0.5,1\n,0.25,0\n007,1.5,1\n")
    with pytest.raises(DataLayoutError, match=r"client column 'writer' has 1 empty ids; every row needs a client"):
        load_data(f"table:{path},client=writer")


def test_a_saved_datasets_dict_brings_its_train_and_test_splits(tmp_path: Path) -> None:
    import datasets

    train = datasets.Dataset.from_dict(rows())
    test = datasets.Dataset.from_dict({k: v[:2] for k, v in rows().items()})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "saved"))
    data = load_data(f"table:{tmp_path / 'saved'},client=user_id,features=pixels+label")
    assert data.test_split == "files" and sorted(data.features) == ["label", "pixels"]
    assert data.test_client_ids == ("u1", "u2") and len(data) == 3
    single = tmp_path / "single"
    train.shuffle(seed=0).save_to_disk(str(single))  # an indices mapping: rows as the dataset shows them
    shuffled = load_table(single, client="user_id", test_split="clients")
    assert sorted(shuffled.client_ids + shuffled.test_client_ids) == ["u1", "u2", "u3"]


def test_a_client_column_that_does_not_exist_lists_the_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table(rows()), tmp_path / "data.parquet")
    with pytest.raises(DataSpecError, match="no client column 'user'; its columns are user_id, pixels, text, label"):
        load_table(tmp_path / "data.parquet", client="user")


def test_ragged_list_columns_and_missing_values_are_refused(tmp_path: Path) -> None:
    ragged = rows()
    ragged["pixels"][0] = [0.1]
    pq.write_table(pa.table(ragged), tmp_path / "ragged.parquet")
    with pytest.raises(DataLayoutError, match="lists of different lengths"):
        load_table(tmp_path / "ragged.parquet", client="user_id")
    holes = rows()
    holes["label"][1] = None
    pq.write_table(pa.table(holes), tmp_path / "holes.parquet")
    with pytest.raises(DataLayoutError, match="1 missing values"):
        load_table(tmp_path / "holes.parquet", client="user_id")


def test_files_that_are_not_tables_say_what_to_give(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_text("nope")
    with pytest.raises(DataLayoutError, match="not a Parquet file"):
        load_table(tmp_path / "x.parquet", client="c")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(DataSpecError, match="neither .parquet, .csv"):
        load_table(tmp_path / "x.json", client="c")
    with pytest.raises(DataLayoutError, match=r"x\.parquet is not a Parquet file"):
        load_table(tmp_path, client="c")  # a folder of Parquet files, one of them not Parquet
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "x.json").write_text("{}")
    with pytest.raises(DataLayoutError, match=r"is a folder of no table files \(found \.json\), .*save_to_disk"):
        load_table(tmp_path / "json", client="c")
    (tmp_path / "header.csv").write_text("user,x,label\n")  # its columns typed null: 'x has type null' was said
    with pytest.raises(DataLayoutError, match=r"header\.csv has no rows$"):
        load_table(tmp_path / "header.csv", client="user")


def test_a_column_named_twice_or_a_csv_that_is_not_utf8_is_refused_saying_so(tmp_path: Path) -> None:
    pq.write_table(pa.table([["a", "b"], [1, 2], [0, 1]], names=["user_id", "x", "x"]), tmp_path / "twice.parquet")
    (tmp_path / "twice.csv").write_text("user_id,user_id,label\na,1,0\n")
    for name, column in (("twice.parquet", "x"), ("twice.csv", "user_id")):
        with pytest.raises(DataLayoutError, match=f"has the column '{column}' more than once"):
            load_table(tmp_path / name, client="user_id")
    (tmp_path / "latin1.csv").write_bytes("user_id,größe,label\na,1,0\n".encode("latin-1"))
    with pytest.raises(
        DataLayoutError, match=r"latin1\.csv is not UTF-8 text \(invalid .* at byte \d+\); save it as UTF-8"
    ):
        load_table(tmp_path / "latin1.csv", client="user_id")


def test_list_columns_keep_their_dtype_and_nested_lists_their_shape(tmp_path: Path) -> None:
    """Lists are read from Arrow's buffers: float32 stays float32, a list of lists is [N, H, W]."""
    x = np.arange(24, dtype=np.float32).reshape(6, 2, 2) / 24
    flat = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4)
    nested = pa.array(x.tolist(), type=pa.list_(pa.list_(pa.float32())))
    table = pa.table({"c": ["a", "b"] * 3, "flat": flat, "image": nested, "y": [0, 1] * 3})
    pq.write_table(table, tmp_path / "lists.parquet")
    data = load_table(tmp_path / "lists.parquet", client="c", test_split="clients", test_fraction=0.5)
    assert data.features["flat"].dtype == "float32" and data.features["flat"].shape == (4,)
    assert data.features["image"].dtype == "float32" and data.features["image"].shape == (2, 2)
    everything = {**data.train, **data.test}
    assert np.array_equal(everything["b"]["image"], x[1::2]) and np.array_equal(
        everything["a"]["flat"], x[::2].reshape(3, 4)
    )


def _loaded_with_peak(path: Path) -> tuple[FederatedDataset, int]:
    """The table at ``path`` read by client ``c``, and the peak of what Python allocated meanwhile."""
    tracemalloc.start()
    try:
        data = load_table(path, client="c", test_split="clients")
        return data, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_list_column_is_read_without_a_python_object_per_value(tmp_path: Path) -> None:
    """200,000 rows of 784 floats took 10 GB and 40 s as Python floats; tracemalloc sees numpy's
    arrays and Python's objects, so the peak over the final arrays bounds what reading made."""
    rows, width = 4000, 256
    values = pa.array(np.random.default_rng(0).random(rows * width, dtype=np.float32))
    pq.write_table(
        pa.table({"c": [f"c{i % 40}" for i in range(rows)], "x": pa.FixedSizeListArray.from_arrays(values, width)}),
        tmp_path / "wide.parquet",
    )
    data, peak = _loaded_with_peak(tmp_path / "wide.parquet")
    size = rows * width * 4
    assert data.features["x"].dtype == "float32" and peak < 4 * size  # as Python floats: over 8 times


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e39])
def test_nan_infinite_or_float32_overflowing_values_are_refused_naming_column_and_row(
    tmp_path: Path, bad: float
) -> None:
    """Parquet's NaN is a value, not a null: it trained devices on NaN, where LEAF and HDF5 refused it."""
    vectors = [[0.5, 0.5], [0.1, 0.2], [0.3, bad]]
    pq.write_table(pa.table({"c": ["a", "a", "b"], "x": vectors, "y": [0, 1, 0]}), tmp_path / "v.parquet")
    with pytest.raises(
        DataLayoutError, match=r"column 'x' holds values that are NaN, infinite .*: 1 of them, the first in row 2"
    ):
        load_data(f"table:{tmp_path / 'v.parquet'},client=c")
    (tmp_path / "s.csv").write_text(f"c,x,y\na,0.5,0\nb,{bad},1\n")  # a CSV's nan is a missing value
    says = "has 1 missing values" if np.isnan(bad) else "holds values that are NaN, infinite .* first in row 1"
    with pytest.raises(DataLayoutError, match=rf"column 'x' {says}"):
        load_data(f"table:{tmp_path / 's.csv'},client=c")


def images(n: int, seed: int, size: int = 6) -> dict[str, list[object]]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (n, size, size), dtype=np.uint8)
    return {
        "image": [Image.fromarray(p, mode="L") for p in pixels],
        "label": [i % 3 for i in range(n)],
        "writer_id": [f"w{i % 4}" for i in range(n)],
        "pixels": pixels,  # what the decoded images must equal (not a column)
    }


def test_a_saved_datasetdict_of_images_and_class_labels_decodes_the_pixels(tmp_path: Path) -> None:
    """What flwrlabs/femnist holds: an Image column, a ClassLabel label and a writer column."""
    import datasets

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=["0", "1", "2"]),
            "writer_id": datasets.Value("string"),
        }
    )
    splits = {name: images(n, seed) for name, n, seed in (("train", 24, 0), ("test", 8, 1))}
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({k: v for k, v in s.items() if k != "pixels"}, features=features)
            for name, s in splits.items()
        }
    ).save_to_disk(str(tmp_path / "saved"))
    data = load_data(f"table:{tmp_path / 'saved'},client=writer_id")
    assert data.features["image"].dtype == "uint8" and data.features["image"].shape == (6, 6)
    assert data.label == "label" and data.test_split == "files" and data.client_ids == ("w0", "w1", "w2", "w3")
    assert np.array_equal(data.train["w1"]["image"], splits["train"]["pixels"][1::4])
    assert list(data.test["w0"]["label"]) == [0, 1]
    hub = tmp_path / "femnist.parquet"  # the Hub's Parquet files hold the same struct of bytes and path
    datasets.load_from_disk(str(tmp_path / "saved"))["train"].to_parquet(str(hub))
    from_hub = load_table(hub, client="writer_id", test_split="clients")
    assert np.array_equal({**from_hub.train, **from_hub.test}["w1"]["image"], splits["train"]["pixels"][1::4])


def test_datasets_cache_folder_as_load_dataset_and_flwr_datasets_leave_it_reads_its_splits(tmp_path: Path) -> None:
    """load_dataset (and so flwr-datasets' FederatedDataset) turns the Hub's Parquet files into a cache
    folder of dataset_info.json and <name>-<split>.arrow files; it was refused as a damaged
    save_to_disk folder, and its .arrow files (which the data spec's hint names table: for) as no table."""
    import datasets

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=["a", "b", "c"]),
            "writer_id": datasets.Value("string"),
        }
    )
    splits = {name: images(n, seed) for name, n, seed in (("train", 24, 0), ("test", 8, 1))}
    for name, split in splits.items():  # the Hub's Parquet files
        dataset = datasets.Dataset.from_dict({k: v for k, v in split.items() if k != "pixels"}, features=features)
        dataset.to_parquet(str(tmp_path / f"{name}.parquet"))
    files = {name: str(tmp_path / f"{name}.parquet") for name in splits}
    datasets.load_dataset("parquet", data_files=files, cache_dir=str(tmp_path / "cache")).map(lambda row: row)
    [cache] = {p.parent for p in (tmp_path / "cache").rglob("dataset_info.json")}  # beside it a map's cache-*.arrow
    data = load_data(f"table:{cache},client=writer_id")
    assert data.test_split == "files" and data.label_names == ("a", "b", "c") and data.features["image"].shape == (6, 6)
    assert np.array_equal(data.train["w1"]["image"], splits["train"]["pixels"][1::4])
    assert np.array_equal(data.test["w2"]["image"], splits["test"]["pixels"][2::4])
    root = load_data(f"table:{tmp_path / 'cache'},client=writer_id")  # the cache's root: its one dataset
    assert root.num_examples() == 24 and root.num_examples("test") == 8
    [train_file] = cache.glob("*-train*.arrow")
    alone = load_table(train_file, client="writer_id", test_split="clients")
    assert np.array_equal({**alone.train, **alone.test}["w3"]["image"], splits["train"]["pixels"][3::4])
    import pyarrow.feather as feather

    feather.write_feather(pa.table(rows()), str(tmp_path / "rows.feather"))  # Arrow's file format
    assert load_table(tmp_path / "rows.feather", client="user_id").sizes() == {"u1": 1, "u2": 1, "u3": 1}
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataLayoutError, match="junk.arrow is not an Arrow IPC file"):
        load_table(tmp_path / "junk.arrow", client="c")


def test_images_of_different_sizes_or_not_images_are_refused_naming_the_row(tmp_path: Path) -> None:
    import datasets

    rows = images(3, 0)
    rows["image"][2] = rows["image"][2].resize((7, 7))
    del rows["pixels"]
    datasets.Dataset.from_dict(
        rows,
        features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.Value("int64"), "writer_id": datasets.Value("string")}
        ),
    ).save_to_disk(str(tmp_path / "sizes"))
    with pytest.raises(
        DataLayoutError, match=r"column 'image' holds images of different sizes .* uint8\[7, 7\] in row 2\); resize"
    ):
        load_data(f"table:{tmp_path / 'sizes'},client=writer_id")
    by_path = pa.array(  # what datasets' to_parquet writes of images loaded from files: their paths alone
        [{"bytes": None, "path": "/data/0.png"}], type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    )
    pq.write_table(pa.table({"c": ["a"], "image": by_path, "y": [0]}), tmp_path / "paths.parquet")
    with pytest.raises(
        DataLayoutError, match=r"only its path '/data/0.png'\); datasets' save_to_disk embeds the files, "
    ):
        load_table(tmp_path / "paths.parquet", client="c")
    struct = pa.array(
        [{"bytes": b"not a png", "path": "x.png"}], type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    )
    pq.write_table(pa.table({"c": ["a"], "image": struct, "y": [0]}), tmp_path / "junk.parquet")
    with pytest.raises(DataLayoutError, match=r"column 'image', row 0 is not an image PIL reads"):
        load_table(tmp_path / "junk.parquet", client="c")


def test_an_image_column_is_decoded_into_one_array_without_a_copy_per_image(tmp_path: Path) -> None:
    """flwrlabs/femnist's 814,277 PNGs: each image was an array with its own buffer, its file Python
    bytes, and all of them stacked into a copy at the end (100,000 images: 719 MB at the peak for 78
    MB of pixels); the images are decoded into their rows of one array. The load's own peak is the
    pixels and their copy in client order."""
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    files = []
    for _ in range(16):  # FEMNIST's: mostly white, a few hundred bytes of PNG each
        pixels = np.where(rng.random((28, 28)) < 0.9, 255, rng.integers(0, 256, (28, 28))).astype(np.uint8)
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, format="PNG")
        files.append((encoded.getvalue(), pixels))
    rows = 1000
    struct = pa.StructArray.from_arrays(
        [pa.array([files[i % 16][0] for i in range(rows)], pa.binary()), pa.nulls(rows, pa.string())],
        names=["bytes", "path"],
    )
    pq.write_table(pa.table({"c": [f"c{i % 40}" for i in range(rows)], "image": struct}), tmp_path / "femnist.parquet")
    data, peak = _loaded_with_peak(tmp_path / "femnist.parquet")
    assert peak < 2.5 * rows * 28 * 28  # an array and bytes per image, and the stack: 3 times
    assert data.features["image"].shape == (28, 28)
    assert np.array_equal({**data.train, **data.test}["c17"]["image"][1], files[57 % 16][1])


def test_shakespeare_as_flwr_datasets_ships_it_reads_as_leafs_own_with_characters(tmp_path: Path) -> None:
    """flwrlabs/shakespeare is LEAF's Shakespeare as one CSV (character_id, x, y); read as a table its
    x was text no plan reads and its y ids of the characters present (14 here), not LEAF's ids."""
    import csv

    text = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer\n"
    windows = {
        "HAMLET": [(text[i : i + 20], text[i + 20]) for i in range(0, 40)],
        "OPHELIA": [("O, what a noble mind", "~")],
    }
    with (tmp_path / "shakespeare.csv").open("w", newline="") as f:  # as pandas' to_csv writes it
        writer = csv.writer(f)
        writer.writerow(["character_id", "x", "y"])
        writer.writerows([role, x, y] for role, pairs in windows.items() for x, y in pairs)
    leaf = {"users": list(windows), "num_samples": [len(p) for p in windows.values()], "user_data": {}}
    leaf["user_data"] = {u: {"x": [x for x, _ in p], "y": [y for _, y in p]} for u, p in windows.items()}
    (tmp_path / "shakespeare.json").write_text(json.dumps(leaf))
    table = load_data(f"table:{tmp_path / 'shakespeare.csv'},client=character_id,characters=x+y")
    same = load_data(f"leaf:{tmp_path / 'shakespeare.json'}")
    assert table.features == same.features and table.vocabulary == same.vocabulary and table.label == "y"
    for split in ("train", "test"):
        for role, examples in getattr(same, split).items():
            assert all(np.array_equal(getattr(table, split)[role][n], examples[n]) for n in ("x", "y"))
    assert table.train["OPHELIA"]["y"].tolist() == [80]  # a character outside LEAF's 80
    (tmp_path / "ragged.csv").write_text("character_id,x,y\nA,abc,d\nA,ab,c\n")
    with pytest.raises(DataLayoutError, match=r"characters=x: column 'x' holds texts of 3 characters \(row 0\) and 2"):
        load_data(f"table:{tmp_path / 'ragged.csv'},client=character_id,characters=x+y")


def test_text_labels_become_class_ids_in_sorted_order_over_both_splits(tmp_path: Path) -> None:
    """As datasets' class_encode_column numbers them; a class seen only in the test file keeps its id."""
    (tmp_path / "train.csv").write_text('c,x,label\na,0.1,"dog"\na,0.2,cat\nb,0.3,dog\n')
    (tmp_path / "test.csv").write_text("c,x,label\na,0.4,bird\nb,0.5,cat\n")
    data = load_data(f"table:{tmp_path / 'train.csv'},client=c,test={tmp_path / 'test.csv'}")
    assert data.label_names == ("bird", "cat", "dog") and data.features["label"].dtype == "int64"
    assert list(data.train["a"]["label"]) == [2, 1] and list(data.test["a"]["label"]) == [0]
    assert "3 classes named in the files" in data.describe()


def test_stack_makes_a_csvs_numeric_columns_one_vector_in_column_order(tmp_path: Path) -> None:
    """A CSV of many numeric columns (quoted as pandas' QUOTE_NONNUMERIC writes them) for a plan
    that reads one vector; text columns and the label stay features of their own."""
    path = tmp_path / "wide.csv"
    path.write_text(
        '"client","f2","f0","note","f1","label"\n"a",1.5,2,"he said ""hi"", then left",3.25,1\n"b",4,5,"x",6,0\n'
    )
    data = load_data(f"table:{path},client=client,stack=x")
    assert sorted(data.features) == ["label", "note", "x"] and data.features["x"].shape == (3,)
    both = {**data.train, **data.test}
    assert both["a"]["x"].tolist() == [[1.5, 2.0, 3.25]] and both["a"]["note"].tolist() == ['he said "hi", then left']
    assert load_data(f"table:{path},client=client,stack=x,features=f0+f1+label").features["x"].shape == (2,)
    with pytest.raises(DataSpecError, match="stack=note is the name of a column that is not stacked"):
        load_data(f"table:{path},client=client,stack=note")


def test_words_reads_text_columns_as_word_ids_of_the_training_splits_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text("c,text,y\na,good day,1\nb,bad day,0\nb,good good,1\n")
    (tmp_path / "test.csv").write_text("c,text,y\na,awful day,0\n")
    data = load_data(f"table:{tmp_path / 'train.csv'},client=c,test={tmp_path / 'test.csv'},words=text,max_words=3")
    assert data.vocabulary == ("good", "day", "bad") and data.features["text"] == FeatureSpec("uint8", (3,))
    assert data.train["b"]["text"].tolist() == [[2, 1, 3], [0, 0, 3]] and data.test["a"]["text"].tolist() == [[3, 1, 3]]
    with pytest.raises(DataSpecError, match="words=y: feature 'y' is int64, not text"):
        load_data(f"table:{tmp_path / 'train.csv'},client=c,words=y")


def test_pandas_categories_dates_and_decimals_are_read_as_their_values(tmp_path: Path) -> None:
    """What pandas and pyarrow's CSV reader write for them (a dictionary, a timestamp, a decimal)
    was refused, and the whole table with it: a CSV's ISO dates are read as timestamps."""
    import decimal

    import pandas as pd

    frame = pd.DataFrame(
        {
            "c": pd.Categorical(["a", "b", "a"]),
            "kind": pd.Categorical(["cat", "dog", "cat"]),
            "when": pd.to_datetime(["2020-01-01", "2020-01-02", "2020-01-03"]),
            "x": [0.5, 1.5, 2.5],
        }
    )
    frame.to_parquet(tmp_path / "pandas.parquet")
    data = load_table(tmp_path / "pandas.parquet", client="c", label="kind", test_split="clients", test_fraction=0.5)
    everything = {**data.train, **data.test}
    assert data.label_names == ("cat", "dog") and list(everything["a"]["kind"]) == [0, 0]
    assert data.features["when"].dtype == "str" and str(everything["b"]["when"][0]).startswith("2020-01-02")
    (tmp_path / "dates.csv").write_text("c,when,x,y\na,2020-01-01 10:00:00,0.5,1\nb,2020-01-02 11:00:00,1.5,0\n")
    assert load_data(f"table:{tmp_path / 'dates.csv'},client=c").features["when"].dtype == "str"
    money = pa.array([decimal.Decimal("1.25"), decimal.Decimal("2.50")], pa.decimal128(5, 2))
    pq.write_table(pa.table({"c": ["a", "b"], "x": money, "y": [0, 1]}), tmp_path / "money.parquet")
    money_data = load_table(tmp_path / "money.parquet", client="c", test_split="clients", test_fraction=0.5)
    assert money_data.features["x"].dtype == "float64"


def test_a_centralized_table_is_cut_into_clients_by_a_partitioner(tmp_path: Path) -> None:
    """flwr-datasets' way with a Hugging Face dataset: no client column, a seeded partitioner; a
    DatasetDict's test split becomes the central test client, as an npz's x_test does."""
    import datasets

    rng = np.random.default_rng(0)
    splits = {
        name: datasets.Dataset.from_dict({"x": rng.random((n, 3)).tolist(), "label": (np.arange(n) % 5).tolist()})
        for name, n in (("train", 200), ("test", 30))
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "mnistish"))
    spec = f"table:{tmp_path / 'mnistish'},partition=dirichlet,alpha=0.5,clients=10"
    data = load_data(spec, seed=3)
    assert len(data) == 10 and data.num_examples() == 200 and data.test_client_ids == ("central",)
    assert [data.examples(c)["x"].tolist() for c in data.client_ids] == [
        load_data(spec, seed=3).examples(c)["x"].tolist() for c in data.client_ids
    ]
    pq.write_table(pa.table({"x": [0.5] * 40, "label": ["cat", "dog"] * 20}), tmp_path / "central.parquet")
    cut = load_data(f"table:{tmp_path / 'central.parquet'},partition=iid,clients=4")
    assert len(cut) == 4 and cut.test_split == "examples" and cut.label_names == ("cat", "dog")


@pytest.mark.parametrize(
    "options, says",
    [
        ("", "name the client-id column, e.g. .*, or cut the rows into clients with partition=iid|dirichlet"),
        (",client=c,partition=iid", "give client=COLUMN .* or partition=... .*, not both"),
        (",client=c,alpha=0.1", "alpha: options of a table cut into clients with partition=..."),
        (",client=c,test_split=none", "test_split='none' is unknown; use one of examples, clients"),
    ],
)
def test_a_table_takes_its_client_column_or_a_partitioner(tmp_path: Path, options: str, says: str) -> None:
    (tmp_path / "t.csv").write_text("c,x,y\na,0.5,1\n")
    with pytest.raises(DataSpecError, match=says):
        load_data(f"table:{tmp_path / 't.csv'}{options}")


def test_a_folder_of_parquet_files_is_one_table_and_a_hive_folders_client_ids_stay_text(tmp_path: Path) -> None:
    """pyarrow's write_to_dataset and Spark write a folder: the client column only in the folder
    names (client_id=007/...), or part files beside a _metadata file. A folder was refused."""
    table = pa.table({"client_id": ["007", "7", "007", "12"], "x": [[0.5, 1.0], [1.5, 2.0], [2.5, 3.0], [3.5, 4.0]]})
    pq.write_to_dataset(
        table.append_column("y", pa.array([0, 1, 1, 0])), tmp_path / "hive", partition_cols=["client_id"]
    )
    assert sorted(p.name for p in (tmp_path / "hive").iterdir()) == ["client_id=007", "client_id=12", "client_id=7"]
    data = load_table(tmp_path / "hive", client="client_id", test_split="clients", test_fraction=0.34)
    everything = {**data.train, **data.test}
    assert sorted(everything) == ["007", "12", "7"] and sorted(data.features) == ["x", "y"]
    assert everything["007"]["x"].tolist() == [[0.5, 1.0], [2.5, 3.0]] and everything["7"]["y"].tolist() == [1]
    # a misspelt client column: each folder's file has one name, and all rows were one client of that name
    with pytest.raises(
        DataLayoutError, match=r"has no column 'client' \(its columns: x, y, client_id\), and its files'"
    ):
        load_table(tmp_path / "hive", client="client")
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(2):
        pq.write_table(
            pa.table({"client_id": ["a", "b"], "x": [0.5 * i, 1.0], "y": [i, 1]}), parts / f"part-{i}.parquet"
        )
    pq.write_metadata(pq.read_schema(parts / "part-0.parquet"), parts / "_metadata")
    (parts / "_SUCCESS").write_text("")  # Spark's marker; _ and . files are not data
    assert load_table(parts, client="client_id", test_split="clients", test_fraction=0.5).num_examples() == 2
    pq.write_table(pa.table({"client_id": ["c"], "x": [1], "y": [0]}), parts / "part-2.parquet")
    with pytest.raises(
        DataLayoutError,
        match=r"part-2\.parquet has the columns \{client_id: string, x: int64.* but part-0\.parquet has",
    ):
        load_table(parts, client="client_id")


def test_an_integer_and_a_float_client_id_are_one_client(tmp_path: Path) -> None:
    """pandas stores an integer column with a gap as floats: client 7 of the training file and 7.0
    of the test file are one client, as the values are written as Arrow writes them as text."""
    pq.write_table(pa.table({"client_id": [7, 8], "x": [0.25, 0.5], "y": [0, 1]}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"client_id": [7.0, 9.5], "x": [0.25, 0.5], "y": [1, 1]}), tmp_path / "test.parquet")
    data = load_data(f"table:{tmp_path / 'train.parquet'},client=client_id,test={tmp_path / 'test.parquet'}")
    assert data.client_ids == ("7", "8") and data.test_client_ids == ("7", "9.5")
    # a float column's NaN is no null to Parquet: its rows were the client 'nan'
    pq.write_table(
        pa.table({"client_id": [7.0, float("nan")], "x": [0.25, 0.5], "y": [1, 1]}), tmp_path / "nan.parquet"
    )
    with pytest.raises(
        DataLayoutError, match=r"client column 'client_id' has 1 missing values; every row needs a client"
    ):
        load_data(f"table:{tmp_path / 'nan.parquet'},client=client_id")


def test_a_pandas_index_is_not_a_feature_and_an_unnamed_csv_column_is_refused(tmp_path: Path) -> None:
    """A filtered DataFrame's index went into the table as __index_level_0__ (to_parquet,
    datasets' from_pandas), a feature that stack= put into the model's vector without a word."""
    import datasets
    import pandas as pd

    frame = pd.DataFrame(
        {"user": ["a", "b", "a", "b"], "f0": [1.0, 2.0, 3.0, 4.0], "f1": [5.0, 6.0, 7.0, 8.0], "label": [0, 1, 0, 1]}
    )
    kept = frame[frame.f0 != 2.0]  # the index 0, 2, 3: not a range, so it is written as a column

    kept.to_parquet(tmp_path / "kept.parquet")
    datasets.Dataset.from_pandas(kept).save_to_disk(str(tmp_path / "saved"))
    assert "__index_level_0__" in pq.read_schema(tmp_path / "kept.parquet").names
    for path in (tmp_path / "kept.parquet", tmp_path / "saved"):
        data = load_table(path, client="user", stack="x", test_split="clients", test_fraction=0.5)
        assert sorted(data.features) == ["label", "x"] and data.features["x"].shape == (2,)
        assert {**data.train, **data.test}["a"]["x"].tolist() == [[1.0, 5.0], [3.0, 7.0]]
    kept.to_csv(tmp_path / "kept.csv")  # the index's column has no name
    with pytest.raises(
        DataLayoutError,
        match=r"column 1 has no name \(pandas' to_csv writes its index so\); write the file with index=False",
    ):
        load_table(tmp_path / "kept.csv", client="user")
    assert load_table(
        tmp_path / "kept.csv", client="user", features=["f*", "label"], test_split="clients", test_fraction=0.5
    ).features.keys() == {"f0", "f1", "label"}


def test_csvs_as_spreadsheets_write_them_semicolons_decimal_commas_tabs_bom_crlf_and_gzip(tmp_path: Path) -> None:
    """A European spreadsheet's export (semicolons, 2,5), a TSV, a BOM and Windows line ends, a
    gzipped CSV and quoted text with commas and line breaks all read as the same table; the
    semicolon file was one column named 'user;x;note;label;;'."""
    import gzip

    rows = [("a", "0,5", "hi, there\nyou", 1), ("b", "1,25", "x", 0), ("a", "2", "y", 1)]
    (tmp_path / "semi.csv").write_text(  # a spreadsheet's trailing delimiters: two columns of no name and no value
        "user;x;note;label;;\n" + "".join(f'{u};{x};"{n}";{y};;\n' for u, x, n, y in rows)
    )
    comma = "".join(f'{u},{x.replace(",", ".")},"{n}",{y}\r\n' for u, x, n, y in rows)
    (tmp_path / "bom.csv").write_text("user,x,note,label\r\n" + comma, encoding="utf-8-sig")
    with gzip.open(tmp_path / "data.csv.gz", "wt", encoding="utf-8") as out:
        out.write("user,x,note,label\n" + comma.replace("\r\n", "\n"))
    (tmp_path / "data.tsv").write_text(
        "user\tx\tnote\tlabel\n" + "".join(f'{u}\t{x.replace(",", ".")}\t"{n}"\t{y}\n' for u, x, n, y in rows)
    )
    for name in ("semi.csv", "bom.csv", "data.csv.gz", "data.tsv"):
        data = load_table(tmp_path / name, client="user", test_split="clients", test_fraction=0.5)
        both = {**data.train, **data.test}
        assert data.features["x"].dtype == "float64" and both["a"]["x"].tolist() == [0.5, 2.0], name
        assert both["a"]["note"].tolist() == ["hi, there\nyou", "y"] and both["b"]["label"].tolist() == [0], name


def test_a_csv_without_a_header_line_takes_header_no_and_many_columns_are_named_by_a_pattern(tmp_path: Path) -> None:
    """MNIST's CSV: a label and 784 pixel columns, with a header (pixel0...) or without one."""
    pixels = np.arange(12).reshape(3, 4) * 20
    lines = [f"w{i % 2},{i % 3}," + ",".join(map(str, row)) for i, row in enumerate(pixels)]
    (tmp_path / "bare.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(FederatedDataError, match=r"first line looks like data: give header=no"):
        load_data(f"table:{tmp_path / 'bare.csv'},client=writer")
    bare = load_data(
        f"table:{tmp_path / 'bare.csv'},client=f0,header=no,label=f1,stack=x,test_split=clients,test_fraction=0.5"
    )
    assert bare.features["x"].shape == (4,) and {**bare.train, **bare.test}["w1"]["x"].tolist() == [pixels[1].tolist()]
    header = "writer,label," + ",".join(f"pixel{j}" for j in range(4)) + ",hour\n"
    (tmp_path / "named.csv").write_text(header + "".join(line + ",9\n" for line in lines))
    named = load_data(
        f"table:{tmp_path / 'named.csv'},client=writer,features=pixel*+label,stack=x,test_split=clients,test_fraction=0.5"
    )
    assert sorted(named.features) == ["label", "x"] and named.features["x"].shape == (4,)  # hour is left out
    with pytest.raises(DataSpecError, match=r"has no column matching 'pix\?'; its columns are writer, label, pixel0"):
        load_data(f"table:{tmp_path / 'named.csv'},client=writer,features=pix?+label")
    with pytest.raises(DataSpecError, match="header='maybe' is unknown; use yes or no"):
        load_data(f"table:{tmp_path / 'named.csv'},client=writer,header=maybe")


def classlabel_rows(labels: list[int]) -> object:
    import datasets

    features = datasets.Features(
        {
            "user": datasets.Value("string"),
            "x": datasets.Sequence(datasets.Value("float32"), length=2),
            "label": datasets.ClassLabel(names=["zebra", "ant", "cat"]),
        }
    )
    n = len(labels)
    return datasets.Dataset.from_dict(
        {"user": [f"u{i % 2}" for i in range(n)], "x": [[0.5, float(i)] for i in range(n)], "label": labels},
        features=features,
    )


def test_a_classlabel_names_its_classes_and_its_missing_label_minus_one_is_refused(tmp_path: Path) -> None:
    """datasets writes -1 for a ClassLabel's missing label: it trained devices on class -1. A
    DatasetDict of train and validation (no test) brings validation as the test split."""
    import datasets

    datasets.DatasetDict({"train": classlabel_rows([0, 2, 1, 0]), "validation": classlabel_rows([2, 2])}).save_to_disk(
        str(tmp_path / "saved")
    )
    data = load_data(f"table:{tmp_path / 'saved'},client=user,rename=label:y")
    assert data.label_names == ("zebra", "ant", "cat") and data.test_split == "files" and data.num_examples("test") == 2
    assert data.train["u1"]["y"].tolist() == [2, 0] and "3 classes named in the files" in data.describe()
    classlabel_rows([0, 2]).to_parquet(str(tmp_path / "hub.parquet"))  # the Hub's files keep the feature too
    assert load_table(tmp_path / "hub.parquet", client="user", test_split="clients", test_fraction=0.5).label_names == (
        "zebra",
        "ant",
        "cat",
    )
    classlabel_rows([0, -1, 1, -1]).save_to_disk(str(tmp_path / "holes"))
    with pytest.raises(
        DataLayoutError, match=r"column 'label' \(a ClassLabel\) has 2 rows labelled -1, datasets' missing label; drop"
    ):
        load_data(f"table:{tmp_path / 'holes'},client=user")


def test_a_classlabel_client_column_names_its_clients(tmp_path: Path) -> None:
    """A client column saved as a ClassLabel (writer ids numbered by class_encode_column) gave
    clients named by the numbers, 0 and 1, instead of the writers' ids."""
    rows = classlabel_rows([0, 1, 2, 0]).class_encode_column("user")  # type: ignore[attr-defined]
    rows.save_to_disk(str(tmp_path / "writers"))
    data = load_data(f"table:{tmp_path / 'writers'},client=user,test_split=clients,test_fraction=0.5")
    assert sorted(data.client_ids + data.test_client_ids) == ["u0", "u1"]


def test_audio_columns_and_ragged_token_lists_are_refused_saying_what_to_save(tmp_path: Path) -> None:
    """An Audio column (a struct of the file's bytes and path, as an Image's) was decoded as an
    image and refused as 'not an image PIL reads'; ragged token ids (a tokenizer without padding)
    are refused with their lengths."""
    import datasets

    features = datasets.Features(
        {
            "user": datasets.Value("string"),
            "audio": datasets.Audio(sampling_rate=8000),
            "label": datasets.Value("int64"),
        }
    )
    sound = pa.array([{"bytes": b"RIFF0000WAVE", "path": "a.wav"}] * 2)  # not decoded: what it holds does not matter
    table = pa.table({"user": ["a", "b"], "audio": sound, "label": [0, 1]}).cast(features.arrow_schema)
    datasets.Dataset(table, info=datasets.DatasetInfo(features=features)).save_to_disk(str(tmp_path / "audio"))
    with pytest.raises(
        DataLayoutError, match=r"column 'audio' is datasets' Audio feature .*not decoded here; map it to"
    ):
        load_data(f"table:{tmp_path / 'audio'},client=user")
    assert len(load_data(f"table:{tmp_path / 'audio'},client=user,features=label,test_split=clients")) == 1
    datasets.Dataset.from_dict(
        {"user": ["a", "a", "b"], "input_ids": [[5, 6], [5, 6], [7, 8, 9]], "label": [0, 1, 1]}
    ).save_to_disk(str(tmp_path / "tokens"))
    with pytest.raises(
        DataLayoutError,
        match=r"column 'input_ids' holds lists of different lengths \(2 to 3: 2 in row 0, 3 in row 2\); pad or cut "
        r"them to one length with pad=input_ids:LENGTH:VALUE",
    ):
        load_data(f"table:{tmp_path / 'tokens'},client=user")


def test_pad_makes_lists_of_different_lengths_one_length_in_their_own_dtype(tmp_path: Path) -> None:
    """A tokenizer's input_ids without padding: padded with the value given (0 unless given) or cut."""
    ids = pa.array([[5, 6], [5, 6, 7, 8, 9], [7]], pa.list_(pa.int32()))
    pq.write_table(pa.table({"user": ["a", "a", "b"], "input_ids": ids, "label": [0, 1, 1]}), tmp_path / "t.parquet")
    spec = f"table:{tmp_path / 't.parquet'},client=user,test_split=clients,test_fraction=0.5"
    data = load_data(f"{spec},pad=input_ids:3:1")
    both = {**data.train, **data.test}
    assert data.features["input_ids"] == FeatureSpec("int32", (3,))
    assert both["a"]["input_ids"].tolist() == [[5, 6, 1], [5, 6, 7]] and both["b"]["input_ids"].tolist() == [[7, 1, 1]]
    assert {**load_data(f"{spec},pad=input_ids:2").train, **load_data(f"{spec},pad=input_ids:2").test}["b"][
        "input_ids"
    ].tolist() == [[7, 0]]
    for pad, says in (
        ("input_ids:3:0.5", r"pad=input_ids: the value 0.5 is not a int32"),
        ("label:3", r"pad=label: column 'label' has type int64, not lists"),
        ("input_ids", r"'input_ids' is not NAME:LENGTH or NAME:LENGTH:VALUE"),
        ("input_ids:0", r"'input_ids:0' is not NAME:LENGTH"),
    ):
        with pytest.raises(DataSpecError, match=says):
            load_data(f"{spec},pad={pad}")


def test_partitions_saved_one_folder_each_are_clients_named_by_their_folders(tmp_path: Path) -> None:
    """flwr-datasets' way to ship partitions: load_partition(i).train_test_split(...) saved to a
    folder each. The folder of folders was refused as 'a folder without Parquet files'."""
    rows = classlabel_rows([0, 1, 2, 0, 1, 2, 0, 1, 2]).remove_columns("user")
    for i in range(3):
        rows.shard(3, i).train_test_split(test_size=1, seed=0).save_to_disk(str(tmp_path / "parts" / f"partition_{i}"))
    data = load_data(f"table:{tmp_path / 'parts'},client=partition")
    assert data.client_ids == ("partition_0", "partition_1", "partition_2") and data.test_split == "files"
    assert data.sizes() == dict.fromkeys(data.client_ids, 2) and data.num_examples("test") == 3
    assert data.label_names == ("zebra", "ant", "cat") and sorted(data.features) == ["label", "x"]
    classlabel_rows([0, 1]).save_to_disk(str(tmp_path / "parts" / "partition_3"))  # a column of its own
    with pytest.raises(DataLayoutError, match=r"partition_3 has the columns \{user: string.* save every partition"):
        load_data(f"table:{tmp_path / 'parts'},client=partition")


def test_each_clients_test_examples_are_cut_as_split_examples_cuts_them(tmp_path: Path) -> None:
    """The cut is made as the rows are put in client order, instead of copying every client's
    rows a second time: the same examples as split_examples on the grouped clients."""
    from emulator.fleet.federated_data import split_examples
    from emulator.fleet.federated_data.table import group_by_client

    rng = np.random.default_rng(0)
    ids = rng.choice(["a", "b", "c", "d", "e"], 120, p=[0.5, 0.3, 0.1, 0.09, 0.01])
    table = pa.table({"c": ids, "x": rng.random((120, 3)).tolist(), "y": rng.integers(0, 4, 120)})
    pq.write_table(table, tmp_path / "t.parquet")
    data = load_table(tmp_path / "t.parquet", client="c", test_fraction=0.3, seed=5)
    train, test = split_examples(group_by_client(table, "c", None, "t", label="y"), 0.3, 5)
    assert data.client_ids == tuple(train) and data.test_client_ids == tuple(test) and data.test_split == "examples"
    for mine, theirs in ((data.train, train), (data.test, test)):
        assert all(np.array_equal(mine[c][n], theirs[c][n]) for c in theirs for n in ("x", "y"))


def test_json_lines_are_a_table_and_a_client_id_that_is_a_number_here_and_text_there_is_refused(tmp_path: Path) -> None:
    """datasets' to_json and pandas' to_json(lines=True) write one object a line."""
    rows = [{"user": 7, "x": [0.5, 1.0], "label": "cat"}, {"user": 8, "x": [1.5, 2.0], "label": "dog", "note": None}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    with pytest.raises(
        DataLayoutError, match="column 'note' has 4 missing values; .* or leave the column out with features="
    ):
        load_table(tmp_path / "d.jsonl", client="user")
    data = load_table(
        tmp_path / "d.jsonl", client="user", features=["x", "label"], test_split="clients", test_fraction=0.5
    )
    assert sorted(data.client_ids + data.test_client_ids) == ["7", "8"] and data.features["x"] == FeatureSpec(
        "float64", (2,)
    )
    assert data.label_names == ("cat", "dog")
    (tmp_path / "mixed.jsonl").write_text('{"user": 7, "y": 0}\n{"user": "7", "y": 1}\n')
    with pytest.raises(DataLayoutError, match=r"could not be read as JSON Lines \(.*changed from number to string"):
        load_table(tmp_path / "mixed.jsonl", client="user")


def test_a_csv_written_with_a_space_after_each_comma_has_the_names_and_values_without_it(tmp_path: Path) -> None:
    """'user, x, label' named the columns ' x' and ' label': the label was not found, and
    ' cat' and 'cat' were two classes."""
    (tmp_path / "spaced.csv").write_text("x, user, label\n0.5, 007, cat\n1.5, 7,cat\n2.5, 007, dog\n")
    data = load_data(f"table:{tmp_path / 'spaced.csv'},client=user,test_split=clients,test_fraction=0.5")
    assert data.label == "label" and data.label_names == ("cat", "dog") and sorted(data.features) == ["label", "x"]
    assert sorted(data.client_ids + data.test_client_ids) == ["007", "7"] and data.features["x"].dtype == "float64"


def test_a_folder_of_csv_files_one_a_client_takes_each_files_name_as_its_client(tmp_path: Path) -> None:
    """Each client's own file, as many federated datasets ship; a client column in some files only is refused."""
    import gzip

    folder = tmp_path / "clients"
    folder.mkdir()
    (folder / "alice.csv").write_text("x,label\n0.5,1\n1.5,0\n")
    with gzip.open(folder / "bob.v2.csv.gz", "wt") as out:
        out.write("x,label\n2.5,1\n")
    (folder / "README.md").write_text("not a table")
    data = load_data(f"table:{folder},client=user,test_split=clients,test_fraction=0.5")
    assert sorted(data.client_ids + data.test_client_ids) == ["alice", "bob.v2"]
    assert sorted(data.features) == ["label", "x"]
    assert {**data.train, **data.test}["alice"]["x"].tolist() == [0.5, 1.5]
    (folder / "carol.csv").write_text("user,x,label\ncarol,0.5,1\n")
    with pytest.raises(DataLayoutError, match=r"carol\.csv has the client column 'user' but alice\.csv has not"):
        load_data(f"table:{folder},client=user")
    (folder / "carol.csv").unlink()
    (folder / "dave.jsonl").write_text('{"x": 1.0, "label": 0}\n')
    with pytest.raises(DataLayoutError, match=r"is a folder of files of several formats"):
        load_data(f"table:{folder},client=user")


def test_an_empty_text_label_is_a_missing_label_not_a_class(tmp_path: Path) -> None:
    """A CSV's empty label cell is empty text to pyarrow: it became a class named "", trained on."""
    csv = tmp_path / "people.csv"
    csv.write_bytes(
        b'\xef\xbb\xbf"user","age","label"\r\n"u1",31,"cat"\r\n"u1",40,\r\n"u2",22,"dog"\r\n"u2",35,"cat"\r\n'
    )
    with pytest.raises(
        DataLayoutError, match=r"label column 'label' is empty in 1 rows \(the first: row 1\), a missing"
    ):
        load_data(f"table:{csv},client=user")
    with pytest.raises(DataLayoutError, match=r"label column 'label' is empty in 1 rows"):
        load_data(f"table:{csv},partition=iid,clients=2")
    pq.write_table(pa.table({"user": ["a", "b"], "text": ["", "hi"], "label": ["x", "y"]}), tmp_path / "t.parquet")
    texts = load_data(f"table:{tmp_path / 't.parquet'},client=user,test_split=clients,test_fraction=0.5")
    assert texts.label_names == ("x", "y")  # an empty text feature is a text, and stays one


def test_a_folder_file_that_is_a_broken_link_is_named_not_skipped(tmp_path: Path) -> None:
    pq.write_table(pa.table({"user": ["a", "b"], "x": [1.0, 2.0], "label": [0, 1]}), tmp_path / "part-0.parquet")
    (tmp_path / "part-1.parquet").symlink_to(tmp_path / "part-1.parquet")
    with pytest.raises(DataSpecError, match=r"part-1\.parquet is a symbolic link that loops"):
        load_data(f"table:{tmp_path},client=user")


def test_a_test_table_of_no_rows_is_refused_naming_it(tmp_path: Path) -> None:
    """A header-only test CSV was "column 'x' has type null"."""
    (tmp_path / "train.csv").write_text("user,x,label\na,1,0\nb,2,1\n")
    (tmp_path / "test.csv").write_text("user,x,label\n")
    with pytest.raises(DataLayoutError, match=r"the test split of .*test\.csv has no rows; write the test rows"):
        load_data(f"table:{tmp_path / 'train.csv'},client=user,test={tmp_path / 'test.csv'}")
