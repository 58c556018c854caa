"""`fedfleet authority`: it writes a key and its trust anchor, never replaces an existing key
unless told to, and a file it cannot write is refused with a message and leaves no new key."""

from __future__ import annotations

from emulator import AttestationAuthority
from emulator.cli.commands import main
from server_stub import read_trust_anchor


def test_the_key_and_its_trust_anchor_belong_together(tmp_path, capsys):
    key, trust = tmp_path / "a.key", tmp_path / "trust.json"
    assert main(["authority", "--key", str(key), "--trust", str(trust)]) == 0
    assert read_trust_anchor(trust) == AttestationAuthority.load(key).trust_anchor()
    assert key.stat().st_mode & 0o077 == 0  # the private key is the owner's alone


def test_an_existing_key_is_kept_unless_forced(tmp_path, capsys):
    key, trust = tmp_path / "a.key", tmp_path / "trust.json"
    assert main(["authority", "--key", str(key), "--trust", str(trust)]) == 0
    before = key.read_bytes()
    assert main(["authority", "--key", str(key), "--trust", str(tmp_path / "other.json")]) == 2
    assert "already exists" in capsys.readouterr().err and key.read_bytes() == before
    assert not (tmp_path / "other.json").exists()
    assert main(["authority", "--key", str(key), "--trust", str(trust), "--force"]) == 0
    assert key.read_bytes() != before and read_trust_anchor(trust) == AttestationAuthority.load(key).trust_anchor()


def test_a_trust_anchor_that_cannot_be_written_leaves_no_key(tmp_path, capsys):
    key = tmp_path / "a.key"
    assert main(["authority", "--key", str(key), "--trust", str(tmp_path / "missing" / "trust.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "Traceback" not in err and not key.exists()


def test_a_trust_anchor_named_by_a_folder_leaves_no_key(tmp_path, capsys):
    key, folder = tmp_path / "a.key", tmp_path / "anchors"
    folder.mkdir()
    assert main(["authority", "--key", str(key), "--trust", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == f"fedfleet authority: --trust {folder} is a folder; name a file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchors"] and not any(folder.iterdir())


def test_a_forced_replacement_that_fails_leaves_the_old_pair_as_it_was(tmp_path, capsys):
    key, trust = tmp_path / "a.key", tmp_path / "trust.json"
    assert main(["authority", "--key", str(key), "--trust", str(trust)]) == 0
    old_key, old_trust = key.read_bytes(), trust.read_bytes()
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    # the anchor could be written; the key cannot: the anchor must not change alone
    assert main(["authority", "--key", str(blocker / "a.key"), "--trust", str(trust), "--force"]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and f"{blocker / 'a.key'} (" in err  # the file given, not its stand-in
    assert trust.read_bytes() == old_trust and key.read_bytes() == old_key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.key", "not-a-folder", "trust.json"]  # no leftovers


def test_the_key_and_the_anchor_must_be_two_files(tmp_path, capsys):
    same = tmp_path / "both.json"
    assert main(["authority", "--key", str(same), "--trust", str(same)]) == 2
    assert "same file" in capsys.readouterr().err and not same.exists()
