"""The tester's signing key: `fedfleet plan keygen` makes a private key only its owner can read and
the line a server's --release-trust file takes; a report signed with it verifies under that line
and under nothing else (issue 20, defect 7)."""

from __future__ import annotations

import json
import math
import stat

import pytest

from emulator.cli.commands import main
from emulator.toolchain.release_signing import (
    SigningKeyError,
    generate_signing_key,
    load_signing_key,
    public_key_bytes,
    public_key_path,
    sign_report,
)
from server_stub.release_gate import REPORT_FORMAT, ReleaseGateError, check_release_signature
from server_stub.release_trust import ReleaseTrustError, parse_release_trust, read_release_trust

REPORT = {
    "format": REPORT_FORMAT,
    "plan_sha256": "ab" * 32,
    "claimed": ["1.31.1"],
    "passed": True,
    "results": {"1.31.1": {"passed": True, "checks": [{"name": "loads", "passed": True, "detail": "x"}]}},
}


def test_keygen_writes_a_private_key_only_its_owner_reads_and_the_line_a_server_trusts(tmp_path, capsys):
    key = tmp_path / "tester.key"
    assert main(["plan", "keygen", "--key", str(key), "--label", "alice  at the lab"]) == 0
    printed = capsys.readouterr().out
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    line = public_key_path(key).read_text().strip()
    assert line in printed and line.startswith("ed25519 ") and line.endswith(" alice at the lab")
    signing = load_signing_key(key)
    assert read_release_trust(public_key_path(key)) == {public_key_bytes(signing)}
    trusted = read_release_trust(public_key_path(key))
    assert check_release_signature(sign_report(REPORT, signing), trusted) == public_key_bytes(signing)
    assert main(["plan", "keygen", "--key", str(key)]) == 2  # a key servers may trust is not replaced by accident
    assert (
        "--force" in capsys.readouterr().err
        and load_signing_key(key).private_bytes_raw() == signing.private_bytes_raw()
    )
    assert main(["plan", "keygen", "--key", str(key), "--force"]) == 0
    assert load_signing_key(key).private_bytes_raw() != signing.private_bytes_raw()


def test_a_report_signed_with_one_key_verifies_under_no_other(tmp_path):
    mine, theirs = (generate_signing_key(tmp_path / name) for name in ("mine.key", "theirs.key"))
    signed = sign_report(REPORT, mine)
    assert sign_report(signed, mine) == signed  # signing again replaces the signature, it does not sign it
    with pytest.raises(ReleaseGateError) as refused:
        check_release_signature(signed, read_release_trust(public_key_path(tmp_path / "theirs.key")))
    assert refused.value.code == "RELEASE_REPORT_UNTRUSTED"
    assert public_key_bytes(theirs) != public_key_bytes(mine)


def test_plan_test_says_which_key_is_missing_before_running_any_test(tmp_path, capsys):
    assert main(["plan", "test", str(tmp_path / "nothing-built"), "--signing-key", str(tmp_path / "absent.key")]) == 2
    assert "fedfleet plan keygen --key" in capsys.readouterr().err
    (tmp_path / "junk.key").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(SigningKeyError, match="not a release signing key"):
        load_signing_key(tmp_path / "junk.key")
    with pytest.raises(SigningKeyError, match="cannot be signed"):
        sign_report({**REPORT, "measured": math.nan}, generate_signing_key(tmp_path / "k"))


def test_a_file_that_is_not_a_private_key_is_named_as_what_it_is(tmp_path):
    """The public half given for the private one (``KEY.pub``, the likeliest slip), an admin key,
    binary bytes and a folder: each a line that says what the file is, never a JSON decoder's
    message."""
    key = tmp_path / "tester.key"
    generate_signing_key(key)
    (tmp_path / "admin.key").write_text("an-operator-key-0123456789abcdef\n")
    (tmp_path / "binary.key").write_bytes(b"\xff\xfe\x00")
    cases = {
        public_key_path(key): f"{public_key_path(key)} is a public key (the line a server trusts); sign with the "
        f"private key beside it, such as {key}",
        tmp_path / "admin.key": f"{tmp_path / 'admin.key'} is not a release signing key; make one with "
        "`fedfleet plan keygen --key FILE`",
        tmp_path / "binary.key": f"{tmp_path / 'binary.key'} is not a release signing key; make one with "
        "`fedfleet plan keygen --key FILE`",
        tmp_path: f"{tmp_path} is a folder; give the key file `fedfleet plan keygen` wrote",
    }
    for path, says in cases.items():
        with pytest.raises(SigningKeyError) as refused:
            load_signing_key(path)
        assert str(refused.value) == says


@pytest.mark.parametrize(
    "text",
    ["", "# only a comment\n\n", "ed25519\n", "ed25519 %%%\n", "ssh-ed25519 AAAA\n", "ed25519 " + "QUJD" * 4 + "\n"],
)
def test_a_trust_file_that_names_no_usable_key_is_refused(text):
    with pytest.raises(ReleaseTrustError, match="names no key|line 1"):
        parse_release_trust(text)
