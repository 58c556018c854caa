"""TFF's ClientData HDF5 layout (examples/<client id>/<feature>), written here with h5py as TFF's
federated EMNIST and StackOverflow files are, and files that are not in that layout."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from emulator.fleet.federated_data import DataLayoutError, DataSpecError, encode_words, load_data, load_tff_h5


def write_emnist(path: Path, clients: dict[str, int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        for cid, n in clients.items():
            group = f.create_group(f"examples/{cid}")
            group.create_dataset("pixels", data=rng.random((n, 28, 28), dtype=np.float32))
            group.create_dataset("label", data=rng.integers(0, 10, n).astype(np.int32))
    return path


def test_federated_emnist_train_and_test_files_keep_pixels_and_labels(tmp_path: Path) -> None:
    write_emnist(tmp_path / "fed_emnist_digitsonly_train.h5", {"f0000_14": 4, "f0001_41": 2})
    write_emnist(tmp_path / "fed_emnist_digitsonly_test.h5", {"f0000_14": 1, "f0001_41": 1}, seed=1)
    data = load_tff_h5(tmp_path)  # the folder TFF's archive extracts to
    assert data.client_ids == ("f0000_14", "f0001_41") and data.test_split == "files"
    assert data.features["pixels"].dtype == "float32" and data.features["pixels"].shape == (28, 28)
    assert data.features["label"].dtype == "int32" and data.label == "label"
    assert data.sizes() == {"f0000_14": 4, "f0001_41": 2} and data.num_examples("test") == 2
    with h5py.File(tmp_path / "fed_emnist_digitsonly_train.h5") as f:
        assert np.array_equal(data.examples("f0001_41")["pixels"], f["examples/f0001_41/pixels"][()])


def test_stackoverflow_strings_decode_to_text_features(tmp_path: Path) -> None:
    path = tmp_path / "stackoverflow_train.h5"
    strings = h5py.string_dtype()
    with h5py.File(path, "w") as f:
        g = f.create_group("examples/00000001")
        g.create_dataset("tokens", data=["how do i sort a list ?", "use sorted ( ) ."], dtype=strings)
        g.create_dataset("title", data=["sorting lists", "sorting lists"], dtype=strings)
        g.create_dataset("tags", data=["python|list", "python|list"], dtype=strings)
        g.create_dataset("score", data=np.array([3, 5], dtype=np.int64))
    data = load_tff_h5(path, test_fraction=0.5)
    assert data.features["tokens"].dtype == "str" and data.label is None
    tokens = [*data.train["00000001"]["tokens"], *data.test["00000001"]["tokens"]]
    assert sorted(tokens) == ["how do i sort a list ?", "use sorted ( ) ."]
    ids = encode_words(tokens, ["sort", "list"], max_words=3)
    assert ids.dtype == np.int64 and ids.shape == (2, 3)


def test_words_reads_stackoverflows_byte_strings_as_word_ids_of_the_training_vocabulary(tmp_path: Path) -> None:
    """TFF's StackOverflow files hold bytes (no declared string type, or fixed-length); ``words``
    makes their texts the word ids a plan reads, one vocabulary over the features named."""
    train, test = tmp_path / "stackoverflow_train.h5", tmp_path / "stackoverflow_test.h5"
    with h5py.File(train, "w") as f:
        g = f.create_group("examples/00000001")
        g.create_dataset("tokens", data=[b"how do i sort", b"sort it"], dtype=h5py.vlen_dtype(bytes))
        g.create_dataset("title", data=[b"sorting", b"sort"], dtype=h5py.vlen_dtype(bytes))
        g.create_dataset("tags", data=np.array([b"python|list", b"python"]))
        f.create_dataset("examples/00000002/tokens", data=[b"one example"], dtype=h5py.vlen_dtype(bytes))
        f.create_dataset("examples/00000002/title", data=[b"it"], dtype=h5py.vlen_dtype(bytes))
        f.create_dataset("examples/00000002/tags", data=np.array([b"java"]))
    with h5py.File(test, "w") as f:
        f.create_dataset("examples/00000003/tokens", data=[b"sort java"], dtype=h5py.vlen_dtype(bytes))
        f.create_dataset("examples/00000003/title", data=[b"sort"], dtype=h5py.vlen_dtype(bytes))
        f.create_dataset("examples/00000003/tags", data=np.array([b"java"]))
    data = load_data(f"tff-h5:{tmp_path},words=tokens+title,max_words=4,label=tags")
    assert data.vocabulary[:2] == ("sort", "it") and data.features["tokens"].shape == (4,)
    unknown = len(data.vocabulary)
    assert data.test["00000003"]["tokens"].tolist() == [[0, unknown, unknown, unknown]]
    assert data.features["tags"].dtype == "int64" and data.label_names == ("java", "python", "python|list")
    with pytest.raises(DataSpecError, match="words=text: no such feature; the features are tags, title, tokens"):
        load_data(f"tff-h5:{tmp_path},words=text")


def test_a_file_without_the_examples_group_names_what_it_found(tmp_path: Path) -> None:
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("pixels", data=np.zeros((2, 2)))
    with pytest.raises(DataLayoutError, match=r"no 'examples' group \(top level: pixels\)"):
        load_tff_h5(path)


def test_ragged_features_and_clients_that_differ_are_refused(tmp_path: Path) -> None:
    ragged = tmp_path / "ragged.h5"
    with h5py.File(ragged, "w") as f:
        f.create_dataset("examples/a/pixels", data=np.zeros((3, 4), dtype=np.float32))
        f.create_dataset("examples/a/label", data=np.zeros(2, dtype=np.int32))
    with pytest.raises(DataLayoutError, match="ragged features"):
        load_tff_h5(ragged)
    differ = tmp_path / "differ.h5"
    with h5py.File(differ, "w") as f:
        f.create_dataset("examples/a/pixels", data=np.zeros((3, 4), dtype=np.float32))
        f.create_dataset("examples/b/pixels", data=np.zeros((3, 5), dtype=np.float32))
    with pytest.raises(DataLayoutError, match="every client needs one dtype and shape"):
        load_tff_h5(differ)


def test_a_file_that_is_not_hdf5_or_missing_says_so(tmp_path: Path) -> None:
    (tmp_path / "x.h5").write_text("not hdf5")
    with pytest.raises(DataLayoutError, match="not an HDF5 file"):
        load_tff_h5(tmp_path / "x.h5")
    with pytest.raises(DataSpecError, match="does not exist"):
        load_tff_h5(tmp_path / "missing.h5")


def test_without_h5py_the_loader_names_the_extra_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from emulator.fleet.federated_data import MissingDependencyError

    path = write_emnist(tmp_path / "train.h5", {"a": 1})
    monkeypatch.setitem(sys.modules, "h5py", None)  # what an environment without h5py imports
    with pytest.raises(MissingDependencyError, match=r"pip install 'fedfleet\[data\]'"):
        load_tff_h5(path)


def test_a_feature_declared_larger_than_memory_is_refused_naming_it_and_its_shape(tmp_path: Path) -> None:
    """A dataset can be declared with any shape and take no space; reading it was a MemoryError."""
    path = tmp_path / "huge.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/pixels", shape=(10**6, 10**6), dtype=np.float32)
        f.create_dataset("examples/a/label", shape=(10**6,), dtype=np.int32)
    with pytest.raises(DataLayoutError, match=r"examples/a/pixels is declared float32\[1000000, 1000000\], 3725 GiB"):
        load_tff_h5(path)


def test_links_to_other_files_or_to_nothing_are_refused_without_following_them(tmp_path: Path) -> None:
    """h5py follows an external link to whatever file it names: a KeyError, or another file's data."""
    other = write_emnist(tmp_path / "other.h5", {"x": 2})
    path = tmp_path / "linked.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/label", data=np.zeros(2, dtype=np.int32))
        f["examples/a/pixels"] = h5py.ExternalLink(str(other), "/examples/x/pixels")
    with pytest.raises(DataLayoutError, match=r"examples/a/pixels links to '.*other\.h5' \(/examples/x/pixels\)"):
        load_tff_h5(path)
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/label", data=np.zeros(2, dtype=np.int32))
        f["examples/b"] = h5py.ExternalLink("/etc/passwd", "/")
    with pytest.raises(DataLayoutError, match=r"examples/b links to '/etc/passwd'"):
        load_tff_h5(path)
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/label", data=np.zeros(2, dtype=np.int32))
        f["examples/a/pixels"] = h5py.SoftLink("/nowhere")
    with pytest.raises(DataLayoutError, match=r"examples/a/pixels is a link to nothing"):
        load_tff_h5(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e39])
def test_a_feature_with_nan_infinite_or_float32_overflowing_values_is_refused_naming_it(
    tmp_path: Path, bad: float
) -> None:
    """1e39 is finite in a float64 file, and infinite in the float32 tensors a plan reads."""
    path = tmp_path / "nan.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/pixels", data=np.array([[0.5, 0.0], [0.1, bad]]))
        f.create_dataset("examples/a/label", data=np.zeros(2, dtype=np.int32))
    with pytest.raises(
        DataLayoutError,
        match=r"examples/a/pixels holds values that are NaN, infinite or past float32's range .*: 1 of them, the first in example 1",
    ):
        load_tff_h5(path)


def test_a_path_that_exists_but_is_no_file_is_not_said_missing() -> None:
    with pytest.raises(DataSpecError, match="/dev/zero is not a regular file"):
        load_tff_h5("/dev/zero")
