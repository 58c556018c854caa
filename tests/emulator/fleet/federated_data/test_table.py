"""Tables with a client column: Parquet, CSV and a datasets folder written by save_to_disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from emulator.fleet.federated_data import DataLayoutError, DataSpecError, load_data, load_table


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
    with pytest.raises(DataLayoutError, match="save_to_disk"):
        load_table(tmp_path, client="c")


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
