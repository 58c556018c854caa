"""TFF's ClientData HDF5 layout (examples/<client id>/<feature>), written here with h5py as TFF's
federated EMNIST and StackOverflow files are, and files that are not in that layout."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from emulator.fleet.federated_data import (
    DataLayoutError,
    DataSpecError,
    FederatedDataError,
    encode_words,
    load_data,
    load_tff_h5,
)


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
    assert ids.dtype == np.uint8 and ids.shape == (2, 3)


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


def test_stackoverflows_word_count_file_and_space_split_give_tffs_word_ids(tmp_path: Path) -> None:
    """TFF's ``stackoverflow.word_count`` is a word and its count a line, most frequent first, cut to
    ``vocab_size`` (``load_word_counts``); its ``tokens`` are split at spaces, so ``(`` and ``c++``
    are words. Each line was read as one word ("the\t900"), which no text holds: every id unknown."""
    path = tmp_path / "stackoverflow_train.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("examples/00000001")
        g.create_dataset("tokens", data=[b"the c++ ( ) question", b"the end"], dtype=h5py.vlen_dtype(bytes))
    (tmp_path / "stackoverflow.word_count").write_text("the\t900\n(\t800\n)\t700\nc++\t5\nquestion\t4\n")
    spec = f"tff-h5:{path},words=tokens,vocab={tmp_path / 'stackoverflow.word_count'},max_words=5"
    data = load_data(spec + ",vocab_size=4,split=space")
    ids = sorted(np.concatenate([data.train["00000001"]["tokens"], data.test["00000001"]["tokens"]]).tolist())
    assert data.vocabulary == ("the", "(", ")", "c++") and ids == [[0, 3, 1, 2, 4], [0, 4, 4, 4, 4]]
    counted = load_data(f"tff-h5:{path},words=tokens,split=space")  # lazily read: its words counted as split
    assert counted.vocabulary == ("the", "(", ")", "c++", "end", "question")
    leaf = load_data(spec)  # LEAF's tokenizer finds c, no brackets; the default vocab_size keeps all five
    assert leaf.vocabulary == ("the", "(", ")", "c++", "question")
    assert sorted(leaf.train["00000001"]["tokens"].tolist() + leaf.test["00000001"]["tokens"].tolist())[0][:2] == [0, 5]
    (tmp_path / "tag_count.json").write_text('{"python": 30, "java": 20, "c++": 10}')
    assert load_data(f"tff-h5:{path},words=tokens,vocab={tmp_path / 'tag_count.json'},vocab_size=2").vocabulary == (
        "python",
        "java",
    )
    (tmp_path / "phrases.txt").write_text("good movie\nbad\n")
    with pytest.raises(DataLayoutError, match="line 1 holds 'good movie'; a vocabulary file is one word a line"):
        load_data(f"tff-h5:{path},words=tokens,vocab={tmp_path / 'phrases.txt'}")
    with pytest.raises(DataSpecError, match="split='tab' is unknown"):
        load_data(f"tff-h5:{path},words=tokens,split=tab")


def test_a_file_without_the_examples_group_names_what_it_found(tmp_path: Path) -> None:
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("pixels", data=np.zeros((2, 2)))
    with pytest.raises(DataLayoutError, match=r"no 'examples' group \(top level: pixels\)"):
        load_tff_h5(path)


def test_a_feature_nested_in_a_group_is_refused_saying_how_to_flatten_it(tmp_path: Path) -> None:
    path = tmp_path / "nested.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/image/pixels", data=np.zeros((3, 4), dtype=np.float32))
        f.create_dataset("examples/a/label", data=np.zeros(3, dtype=np.int32))
    with pytest.raises(DataLayoutError) as info:
        load_data(f"tff-h5:{path}", seed=0).examples("a")
    assert "examples/a/image is a group" in str(info.value)
    assert "move the datasets inside it up to examples/a/" in str(info.value)
    # a client id with '/' (written unescaped) is such a group too; h5py cannot name a link with '/'
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/f0001/session/pixels", data=np.zeros((3, 4), dtype=np.float32))
        f.create_dataset("examples/f0001/session/label", data=np.zeros(3, dtype=np.int32))
    with pytest.raises(DataLayoutError, match="if f0001/session is one client's id, write it without '/'"):
        load_data(f"tff-h5:{path}")


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


@pytest.mark.parametrize("lazy", [True, False])
def test_a_feature_declared_larger_than_memory_is_refused_naming_it_and_its_shape(tmp_path: Path, lazy: bool) -> None:
    """A dataset can be declared with any shape and take no space; reading it was a MemoryError."""
    path = tmp_path / "huge.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/pixels", shape=(10**6, 10**6), dtype=np.float32)
        f.create_dataset("examples/a/label", shape=(10**6,), dtype=np.int32)
    with pytest.raises(DataLayoutError, match=r"examples/a/pixels is declared float32\[1000000, 1000000\], 3725 GiB"):
        load_tff_h5(path, lazy=lazy)


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


@pytest.mark.parametrize(("bad", "lazy"), [(np.nan, True), (np.inf, False), (1e39, True), (1e39, False)])
def test_a_feature_with_nan_infinite_or_float32_overflowing_values_is_refused_naming_it(
    tmp_path: Path, bad: float, lazy: bool
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
        load_tff_h5(path, lazy=lazy)


def test_a_path_that_exists_but_is_no_file_is_not_said_missing() -> None:
    with pytest.raises(DataSpecError, match="/dev/zero is not a regular file"):
        load_tff_h5("/dev/zero")


def write_text_clients(path: Path, clients: dict[str, int], seed: int = 0) -> Path:
    """StackOverflow's kind of client: texts, a text label, a float score, and empty clients."""
    rng = np.random.default_rng(seed)
    words = np.array(["sort", "a", "list", "java", "it", "?"])
    with h5py.File(path, "w") as f:
        for cid, n in clients.items():
            g = f.create_group(f"examples/{cid}")
            g.create_dataset(
                "tokens", data=[" ".join(rng.choice(words, 3)).encode() for _ in range(n)], dtype=h5py.vlen_dtype(bytes)
            )
            g.create_dataset(
                "tags", data=np.array([rng.choice([b"python", b"java", b"c"]) for _ in range(n)], dtype="S6")
            )
            g.create_dataset("score", data=rng.normal(size=n))
    return path


def same_dataset(a: object, b: object) -> None:
    assert a.client_ids == b.client_ids and a.test_client_ids == b.test_client_ids  # type: ignore[attr-defined]
    assert a.features == b.features and a.label_names == b.label_names and a.vocabulary == b.vocabulary  # type: ignore[attr-defined]
    assert a.sizes() == b.sizes() and a.sizes("test") == b.sizes("test") and a.test_split == b.test_split  # type: ignore[attr-defined]
    for split in ("train", "test"):
        for cid in getattr(a, split):
            x, y = getattr(a, split)[cid], getattr(b, split)[cid]
            assert x.keys() == y.keys()
            for name in x:
                assert x[name].dtype == y[name].dtype and np.array_equal(x[name], y[name]), (split, cid, name)
    feature = a.label or "score"  # type: ignore[attr-defined]
    assert np.array_equal(a.values(feature), b.values(feature))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "options",
    ["", ",test_split=clients,test_fraction=0.3", ",words=tokens,max_words=4,label=tags", ",rename=pixels:x+label:y"],
)
def test_lazily_read_clients_are_the_arrays_an_eager_load_gives(tmp_path: Path, options: str) -> None:
    """A lazy load reads shapes, floats and labels up front and each client's arrays when asked
    for; every split, word id, label id and renamed feature is the eager load's."""
    write_emnist(tmp_path / "emnist_train.h5", {f"c{i}": n for i, n in enumerate([5, 1, 0, 12, 3, 7])})
    write_text_clients(tmp_path / "so_train.h5", {f"{i:04d}": n for i, n in enumerate([4, 0, 6, 2, 9])})
    for name in ("emnist_train.h5", "so_train.h5"):
        if ("words" in options and name.startswith("emnist")) or ("rename" in options and name.startswith("so")):
            continue
        spec = f"tff-h5:{tmp_path / name}{options},seed=3"
        lazy, eager = load_data(spec), load_data(spec + ",lazy=no")
        assert type(lazy.train).__name__ == "LazyClients" and isinstance(eager.train, type(eager.test))
        same_dataset(lazy, eager)


def test_a_lazy_dataset_keeps_its_last_clients_within_its_budget_and_reads_the_others_again() -> None:
    from emulator.fleet.federated_data import FeatureSpec, FederatedDataset
    from emulator.fleet.federated_data._dataset import LazyClients

    reads: list[str] = []

    def read(client: str) -> dict[str, np.ndarray]:
        reads.append(client)
        n = int(client)
        return {"x": np.full((n, 100), float(n), dtype=np.float32), "y": np.full(n, n)}  # 408 bytes an example

    features = {"x": FeatureSpec("float32", (100,)), "y": FeatureSpec("int64", ())}
    labels = {c: np.full(int(c), int(c)) for c in "123"}
    clients = LazyClients({"1": 1, "2": 2, "3": 3, "0": 0}, features, read, label="y", labels=labels, budget=1500)
    data = FederatedDataset(clients, label="y")
    assert data.client_ids == ("1", "2", "3") and "0" not in data.train and data.sizes() == {"1": 1, "2": 2, "3": 3}
    assert data.values("y").tolist() == [1, 2, 2, 3, 3, 3] and reads == []  # the labels read up front
    assert data.examples("3")["x"].shape == (3, 100) and data.train["3"]["x"][0, 0] == 3.0
    data.train["1"], data.train["1"], data.train["2"]  # 1 puts 3 (1,224 bytes) out; 2 is kept beside 1
    data.train["1"], data.train["3"]
    assert reads == ["3", "1", "2", "3"]
    with pytest.raises(KeyError, match="no train client '0'"):
        data.examples("0")


def test_a_fleet_on_a_lazily_read_file_runs_to_the_digest_of_an_eager_read(tmp_path: Path) -> None:
    from emulator.fleet import FleetConfig, simulate
    from emulator.fleet.federated_data import parse_data_spec

    path = write_emnist(tmp_path / "fed_emnist_train.h5", {f"f{i:04d}": 6 + i % 5 for i in range(16)})
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        "[fleet]\ndevices = 24\nhours = 1.0\nstart_utc_hour = 6.0\n\n[task]\ngoal_count = 6\n"
        "report_timeout_s = 600.0\nselection_timeout_s = 300.0\ncompute_s_per_example = 0.2\n"
    )
    config = FleetConfig.load(fleet)
    runs = [
        simulate(config.replace(data=parse_data_spec(f"tff-h5:{path},test_split=clients{lazy}")), progress=False)
        for lazy in ("", ",lazy=no")
    ]
    summary = runs[0].summary()
    assert runs[0].digest == runs[1].digest and summary["data_clients"] == 14 and summary["rounds_committed"] >= 1


def test_text_that_is_not_utf8_is_refused_naming_the_feature(tmp_path: Path) -> None:
    path = tmp_path / "latin1.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("examples/a/tokens", data=[b"ok", b"caf\xe9"], dtype=h5py.vlen_dtype(bytes))
    with pytest.raises(DataLayoutError, match=r"examples/a/tokens holds text that is not UTF-8 \(.* at byte 3\)"):
        load_tff_h5(path)


def test_the_lazy_option_takes_yes_or_no(tmp_path: Path) -> None:
    path = write_emnist(tmp_path / "train.h5", {"a": 2})
    with pytest.raises(DataSpecError, match="tff-h5: lazy='later' is unknown; use yes or no"):
        load_data(f"tff-h5:{path},lazy=later")


@pytest.mark.parametrize("options", ["", ",lazy=no", ",test_split=clients"])
def test_variable_length_numbers_are_refused_up_front_naming_the_dataset(tmp_path: Path, options: str) -> None:
    """Token ids written as an HDF5 variable-length type were read as text ('str', the feature's
    dtype up front) and then refused as 'ragged or mixed' in a client named by the split only."""
    path = tmp_path / "ids.h5"
    with h5py.File(path, "w") as f:
        f.create_group("metadata").attrs["version"] = 1  # a group beside examples is not read
        for cid in ("a", "b", "c"):
            ids = f.create_dataset(f"examples/{cid}/ids", (2,), dtype=h5py.vlen_dtype(np.int32))
            ids[0], ids[1] = np.arange(1, dtype=np.int32), np.arange(3, dtype=np.int32)
            f.create_dataset(f"examples/{cid}/label", data=np.array([0, 1]))
    with pytest.raises(
        DataLayoutError,
        match=r"examples/a/ids holds sequences of int32 of different lengths .*write each example padded",
    ):
        load_data(f"tff-h5:{path}{options}")


@pytest.mark.parametrize(
    ("dtype", "says"),
    [
        (np.dtype([("a", "<i4"), ("b", "<f4")]), r"compound \(a, b\)"),
        (np.dtype("complex64"), "complex64"),
        (h5py.ref_dtype, "object reference"),
    ],
)
@pytest.mark.parametrize("options", ["", ",lazy=no"])
def test_a_feature_of_no_number_or_text_type_is_refused_naming_its_dataset(
    tmp_path: Path, dtype: np.dtype, says: str, options: str
) -> None:
    """A compound label (in every client) was a feature of dtype void64 and a complex one
    complex128, each loaded until a plan or the fleet's checks failed on it."""
    path = write_emnist(tmp_path / "train.h5", {"a": 2, "b": 2})
    with h5py.File(path, "a") as f:
        del f["examples/b/label"]
        f.create_dataset("examples/b/label", (2,), dtype=dtype)
    with pytest.raises(
        DataLayoutError, match=rf"examples/b/label holds {says} values; a feature holds numbers or text"
    ):
        load_data(f"tff-h5:{path}{options}")


def test_shakespeare_snippets_become_leafs_next_character_windows_with_chars(tmp_path: Path) -> None:
    """TFF's Shakespeare holds each role's lines as byte strings (snippets) and nothing else: no
    plan reads text, so it loaded with no label and could not be trained on."""
    from emulator.fleet.federated_data import LEAF_CHARACTERS, encode_characters

    lines = {"KING_LEAR_KING": [b"Attend the lords of France", b"Give me the map."], "LEAR_FOOL": [b"Nuncle!"]}
    for split in ("train", "test"):
        with h5py.File(tmp_path / f"shakespeare_{split}.h5", "w") as f:
            for role, snippets in lines.items():
                f.create_dataset(
                    f"examples/{role}/snippets", data=np.array(snippets, dtype=object), dtype=h5py.string_dtype()
                )
    data = load_data(f"tff-h5:{tmp_path},chars=snippets,window=10")
    text = "Attend the lords of France\nGive me the map."
    assert data.client_ids == ("KING_LEAR_KING",) and data.test_split == "files"  # the fool's 7 characters: none
    assert data.label == "y" and data.vocabulary == tuple(LEAF_CHARACTERS) and data.features["x"].shape == (10,)
    king = data.train["KING_LEAR_KING"]
    assert king["x"].tolist() == [encode_characters(text[i : i + 10]).tolist() for i in range(len(text) - 10)]
    assert king["y"].tolist() == encode_characters(text[10:]).tolist()
    sparse = load_data(f"tff-h5:{tmp_path / 'shakespeare_train.h5'},chars=snippets,window=10,step=8")
    assert sparse.num_examples() + sparse.num_examples("test") == 5  # starts 0, 8, ..., 32 of 43 characters
    for options, says in [
        ("chars=snippet", "chars=snippet: no such feature; the features are snippets"),
        ("chars=snippets,label=snippets", "leave out label= and words="),
        ("window=10", "window= and step= cut the text chars=FEATURE names"),
        ("chars=snippets,window=80", "no client's snippets hold more than 80 characters; lower window="),
    ]:
        with pytest.raises(FederatedDataError, match=says):
            load_data(f"tff-h5:{tmp_path},{options}")


def test_a_file_cut_short_says_how_much_of_it_there_is(tmp_path: Path) -> None:
    """A copy that stopped early was "not an HDF5 file", which sent its user looking for another format."""
    with h5py.File(tmp_path / "whole.h5", "w") as f:
        f.create_dataset("examples/f0000_14/pixels", data=np.zeros((4, 28, 28), np.float32))
        f.create_dataset("examples/f0000_14/label", data=np.arange(4, dtype=np.int32))
    whole = (tmp_path / "whole.h5").read_bytes()
    (tmp_path / "cut.h5").write_bytes(whole[:5000])
    with pytest.raises(DataLayoutError, match=rf"cut\.h5 is cut short: 5,000 of the {len(whole):,} bytes HDF5 wrote"):
        load_tff_h5(tmp_path / "cut.h5")


@pytest.mark.parametrize("lazy", ["yes", "no"])
def test_a_test_file_of_no_examples_is_refused_naming_it(tmp_path: Path, lazy: str) -> None:
    """Read lazily it was "the test split's features {} differ"; read at once, no test split unsaid."""
    for split, n in (("train", 3), ("test", 0)):
        with h5py.File(tmp_path / f"fed_emnist_{split}.h5", "w") as f:
            f.create_dataset("examples/f0000_14/pixels", data=np.zeros((n, 28, 28), np.float32))
            f.create_dataset("examples/f0000_14/label", data=np.zeros(n, np.int32))
    with pytest.raises(DataLayoutError, match=r"the test file .*fed_emnist_test\.h5 holds no client with examples"):
        load_data(f"tff-h5:{tmp_path},lazy={lazy}")
