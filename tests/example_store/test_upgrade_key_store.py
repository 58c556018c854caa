"""A key store file of a later format than this version reads (a newer release's, then an older
release run over it) is refused saying so, and left as it is: said to be damaged, it was restored
from a backup or deleted, and with it the keys of every store sealed since."""

from __future__ import annotations

import json
import os

import pytest

from example_store import FileKeyStore, KeyStoreError, SQLiteExampleStore

from .store_helpers import URI, make_examples


def test_a_key_store_of_a_newer_format_is_refused_as_such_and_left_as_it_is(tmp_path):
    path = tmp_path / "keystore.json"
    with SQLiteExampleStore(tmp_path / "app.db", key_store=FileKeyStore(path)) as store:
        store.add(URI, make_examples(2))
    doc = json.loads(path.read_text())
    doc["version"] += 1  # as the next format stamps it
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    kept, stamp = path.read_bytes(), path.stat().st_mtime_ns
    for call in (
        lambda: FileKeyStore(path).get_key("example_store"),
        lambda: FileKeyStore(path).get_or_create_key("another"),
        lambda: SQLiteExampleStore(tmp_path / "app.db", key_store=FileKeyStore(path)),
    ):
        with pytest.raises(KeyStoreError) as refused:
            call()
        said = str(refused.value)
        assert f"has format version {doc['version']}, written by a newer fedfleet version" in said, said
        assert "damaged" not in said and "\n" not in said
    assert path.read_bytes() == kept and path.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("version", [0, "1", None])
def test_a_key_store_whose_version_is_not_a_newer_one_is_still_damaged(tmp_path, version):
    path = tmp_path / "keystore.json"
    FileKeyStore(path).get_or_create_key("a")
    doc = json.loads(path.read_text())
    doc["version"] = version
    path.write_text(json.dumps(doc))
    with pytest.raises(KeyStoreError, match="is damaged"):
        FileKeyStore(path).get_key("a")
