"""The sealed format on disk, read back with nothing but the module docstring's description and
the ``cryptography`` primitives, so another implementation (an app's own reader, a newer
version) can open it; and the key stores' edge cases.

Format: payload key = HKDF-SHA256(app key, salt, info "fedfleet example_store v2 payload
sealing"); each row is nonce (12) || AES-GCM(ciphertext || tag) with associated data
SHA-256("fedfleet example_store v2 row\\0" || collection id (<q) || URI || \\0 || schema JSON)
|| row id (<q) || timestamp (<d); the key check is AES-GCM of a fixed text with associated data
"key-check\\0" || salt."""

from __future__ import annotations

import base64
import hashlib
import os
import sqlite3
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from example_store import (
    ExampleSelector,
    ExampleStoreError,
    FileKeyStore,
    InMemoryKeyStore,
    KeyStore,
    KeyStoreError,
    SQLiteExampleStore,
)
from example_store.errors import WrongKeyError

ALIAS = "example_store"


def derive(app_key: bytes, salt: bytes, purpose: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt, b"fedfleet example_store v2 " + purpose).derive(app_key)


def meta(path) -> dict[str, str]:
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT key, value FROM store_meta"))


@settings(max_examples=15, deadline=None)
@given(
    uri=st.sampled_from(["app:/digits", "app:/é", "a"]),
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=5),
    first_stamp=st.integers(-(10**6), 10**9).map(float),
)
def test_rows_open_with_the_documented_key_derivation_and_associated_data(tmp_path_factory, uri, values, first_stamp):
    path = tmp_path_factory.mktemp("s") / "app.db"
    keys = InMemoryKeyStore()
    stamps = [first_stamp + i for i in range(len(values))]
    with SQLiteExampleStore(path, key_store=keys) as store:
        store.add(uri, [{"v": np.float64(v)} for v in values], timestamps=stamps)
    app_key = keys.get_key(ALIAS)
    m = meta(path)
    salt = base64.b64decode(m["salt"])
    aead = AESGCM(derive(app_key, salt, b"payload sealing"))
    blob = base64.b64decode(m["key_check"])
    assert aead.decrypt(blob[:12], blob[12:], b"key-check\x00" + salt) == b"fedfleet example store key check"
    with sqlite3.connect(path) as db:
        (coll_id, schema_text) = db.execute("SELECT id, schema FROM collections WHERE uri = ?", (uri,)).fetchone()
        rows = db.execute("SELECT id, timestamp, payload FROM examples ORDER BY id").fetchall()
    prefix = hashlib.sha256(
        b"fedfleet example_store v2 row\x00"
        + struct.pack("<q", coll_id)
        + uri.encode()
        + b"\x00"
        + schema_text.encode()
    ).digest()
    opened = [aead.decrypt(p[:12], p[12:], prefix + struct.pack("<qd", row_id, ts)) for row_id, ts, p in rows]
    assert [np.frombuffer(p, "<f8")[0] for p in opened] == values
    assert [ts for _, ts, _ in rows] == stamps


@pytest.mark.parametrize("field", ["salt", "key_check"])
def test_metadata_that_is_not_strict_base64_is_damage_not_a_wrong_key(tmp_path, field):
    path = tmp_path / "app.db"
    keys = InMemoryKeyStore()
    SQLiteExampleStore(path, key_store=keys).close()
    damaged = meta(path)[field][:-4] + "!" + meta(path)[field][-4:]
    with sqlite3.connect(path) as db:
        db.execute("UPDATE store_meta SET value = ? WHERE key = ?", (damaged, field))
    with pytest.raises(ExampleStoreError, match="damaged") as info:
        SQLiteExampleStore(path, key_store=keys)
    assert not isinstance(info.value, WrongKeyError)


def test_an_unsealed_stores_token_key_that_is_not_strict_base64_is_damage(tmp_path):
    path = tmp_path / "app.db"
    SQLiteExampleStore(path).close()
    with sqlite3.connect(path) as db:
        value = meta(path)["token_key"]
        db.execute("UPDATE store_meta SET value = ? WHERE key = 'token_key'", (value[:4] + "*" + value[4:],))
    with pytest.raises(ExampleStoreError, match="damaged"):
        SQLiteExampleStore(path)


def test_a_key_store_file_with_a_key_that_is_not_strict_base64_is_damaged(tmp_path):
    path = tmp_path / "keys.json"
    store = FileKeyStore(path)
    key = store.get_or_create_key(ALIAS)
    text = path.read_text().replace(
        base64.b64encode(key).decode(), base64.b64encode(key).decode()[:8] + "!" + base64.b64encode(key).decode()[8:]
    )
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(KeyStoreError, match="damaged"):
        store.get_key(ALIAS)


def test_a_key_store_path_that_is_a_folder_is_refused_saying_so(tmp_path):
    folder = tmp_path / "keys.json"
    folder.mkdir(mode=0o700)
    with pytest.raises(KeyStoreError, match=r"keys\.json is a folder; give the path of a file"):
        FileKeyStore(folder).get_or_create_key(ALIAS)
    with pytest.raises(KeyStoreError, match="is a folder"):
        SQLiteExampleStore(tmp_path / "app.db", key_store=FileKeyStore(folder))


@pytest.mark.parametrize("alias", ["", "a\x00b", None, 3])
def test_an_alias_that_is_empty_not_text_or_holds_nul_is_refused(alias):
    with pytest.raises(KeyStoreError):
        InMemoryKeyStore().get_or_create_key(alias)


def test_forgetting_a_key_that_does_not_exist_says_so():
    keys = InMemoryKeyStore()
    assert keys.delete_key("nothing") is False
    keys.get_or_create_key("a")
    assert keys.delete_key("a") is True
    assert keys.aliases() == []


def test_a_key_store_that_only_creates_keys_is_asked_for_the_alias_requested():
    class CreatingOnly(KeyStore):
        def __init__(self):
            self.asked = []

        def get_or_create_key(self, alias):
            self.asked.append(alias)
            return bytes(32)

    keys = CreatingOnly()
    assert keys.get_key("mine") == bytes(32)
    assert keys.asked == ["mine"]


def test_a_file_key_store_names_its_file():
    assert repr(FileKeyStore("/some/where/keys.json")) == "FileKeyStore('/some/where/keys.json')"


def test_a_key_of_a_length_aes_cannot_use_is_refused_whatever_the_store(tmp_path):
    with pytest.raises(KeyStoreError):
        InMemoryKeyStore({"a": bytes(20)})

    class Short(KeyStore):
        def get_or_create_key(self, alias):
            return bytes(31)

    with pytest.raises(KeyStoreError):
        SQLiteExampleStore(tmp_path / "app.db", key_store=Short())


def test_a_sealed_store_read_back_with_the_right_key_returns_what_was_added(tmp_path):
    keys = InMemoryKeyStore()
    with SQLiteExampleStore(tmp_path / "app.db", key_store=keys) as store:
        store.add("app:/a", [{"v": np.float64(i)} for i in range(5)])
    with SQLiteExampleStore(tmp_path / "app.db", key_store=keys) as store:
        assert [float(e["v"]) for e in store.query(ExampleSelector("app:/a"))] == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(WrongKeyError):
        SQLiteExampleStore(tmp_path / "app.db", key_store=InMemoryKeyStore({ALIAS: bytes(32)}))
