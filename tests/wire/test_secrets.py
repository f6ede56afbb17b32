"""How every secret source becomes bytes (docs/security.md), and which files are refused."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from meshkit import wire
from meshkit.errors import AuthenticationError, ConfigError

from tests.support.channels import channel_pair
def _private(path, data: bytes):
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def test_a_file_is_its_raw_bytes_stripped_never_hex_decoded(tmp_path):
    assert wire.read_secret_file(_private(tmp_path / "a", b"0123456789abcdef\n")) == \
        b"0123456789abcdef"
    assert wire.read_secret_file(_private(tmp_path / "b", b"  0123456789abcdef\r\n\n")) == \
        b"0123456789abcdef"
    raw = bytes(range(0x80, 0xA0))  # binary: kept byte for byte (no whitespace at the ends)
    assert wire.read_secret_file(_private(tmp_path / "c", raw)) == raw


def test_the_readme_secret_command_makes_a_64_byte_secret_as_documented(tmp_path):
    readme = Path(__file__).resolve().parents[2] / "README.md"
    (line,) = [ln for ln in readme.read_text().splitlines() if "openssl rand -hex 32" in ln]
    command = line.split("#")[0].strip()
    if shutil.which("openssl") is None:
        pytest.skip("no openssl here")
    subprocess.run(command, shell=True, check=True, cwd=tmp_path)
    secret = wire.read_secret_file(tmp_path / "secret")
    assert len(secret) == 64 and bytes.fromhex(secret.decode())  # the hex text itself


def test_the_environment_is_stripped_and_utf8_encoded():
    assert wire.secret_from_text(" pässwörd-0123456789\n") == "pässwörd-0123456789".encode()


@pytest.mark.parametrize("source", ["file", "env", "api"])
def test_one_minimum_of_16_bytes_for_every_source(tmp_path, source):
    short, enough = b"x" * 15, b"x" * 16
    if source == "file":
        with pytest.raises(ConfigError, match="holds 15 bytes; use at least 16"):
            wire.read_secret_file(_private(tmp_path / "s", short + b"\n"))
        assert wire.read_secret_file(_private(tmp_path / "t", enough)) == enough
    elif source == "env":
        with pytest.raises(ConfigError, match="MESHKIT_SECRET holds 15 bytes"):
            wire.secret_from_text(short.decode() + "\n")
        assert wire.secret_from_text(enough.decode()) == enough
    else:
        with pytest.raises(ConfigError, match="is 15 bytes; use at least 16"):
            channel_pair(short, short)
        a, b = channel_pair(enough, enough)
        a.close(), b.close()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o700 | 0o010])
def test_secret_and_key_files_others_can_reach_are_refused(tmp_path, mode):
    path = _private(tmp_path / "secret", b"0123456789abcdef0123")
    path.chmod(mode)
    with pytest.raises(ConfigError, match="accessible by group or others .*chmod 600"):
        wire.read_secret_file(path)
    wire.generate_node_key(tmp_path / "key")
    (tmp_path / "key").chmod(mode)
    with pytest.raises(ConfigError, match="accessible by group or others"):
        wire.load_node_key(tmp_path / "key")


def test_keygen_writes_a_private_key_and_an_authorized_nodes_line(tmp_path):
    public = wire.generate_node_key(tmp_path / "node", comment="lab-1")
    assert (tmp_path / "node").stat().st_mode & 0o777 == 0o600
    line = (tmp_path / "node.pub").read_text().strip()
    assert line.startswith("meshkit-ed25519 ") and line.endswith(" lab-1")
    assert wire.parse_public_key(line) == public == wire.load_node_key(tmp_path / "node").public
    with pytest.raises(ConfigError, match="already exists"):
        wire.generate_node_key(tmp_path / "node")


def test_authorized_nodes_bind_ranks_and_revoke(tmp_path):
    keys = {}
    for name in ("any", "two", "gone"):
        keys[name] = wire.generate_node_key(tmp_path / name)
    other = wire.generate_node_key(tmp_path / "other")
    text = "\n".join([
        "# the lab",
        wire.public_key_text(keys["any"]),
        wire.public_key_text(keys["two"]) + " rank=2 gpu box",
        wire.public_key_text(keys["gone"]),
        "revoked " + wire.public_key_text(keys["gone"]),
    ])
    (tmp_path / "authorized").write_text(text)
    nodes = wire.load_authorized_nodes(tmp_path / "authorized")
    assert nodes.problem(keys["any"], 5) is None
    assert nodes.problem(keys["two"], 2) is None
    assert "bound to rank 2" in nodes.problem(keys["two"], 1)
    assert "revoked" in nodes.problem(keys["gone"], 1)
    assert "unknown" in nodes.problem(other, 1)
    assert "no node key" in nodes.problem(None, 1)
    (tmp_path / "bad").write_text("meshkit-ed25519 not-base64!\n")
    with pytest.raises(ConfigError, match="bad:1"):
        wire.load_authorized_nodes(tmp_path / "bad")


def test_a_tag_bound_to_a_key_is_carried_by_it_and_reserved_from_every_other(tmp_path):
    gpu = wire.generate_node_key(tmp_path / "gpu")
    plain = wire.generate_node_key(tmp_path / "plain")
    gone = wire.generate_node_key(tmp_path / "gone")
    (tmp_path / "authorized").write_text("\n".join([
        wire.public_key_text(gpu) + " rank=1 tag=gpu-box,trusted lab",
        wire.public_key_text(plain),
        wire.public_key_text(gone) + " tag=edge",
        "revoked " + wire.public_key_text(gone),
    ]))
    nodes = wire.load_authorized_nodes(tmp_path / "authorized")
    assert nodes.keys[0].tags == {"gpu-box", "trusted"} and nodes.keys[0].comment == "lab"
    # The bound key carries its tags even when it does not advertise them.
    assert nodes.tags_for(gpu, 1, ["cpu", "linux"]) == ("cpu", "linux", "gpu-box", "trusted")
    # Another key may not claim them (say, a hostname of gpu-box) ...
    with pytest.raises(AuthenticationError, match=r"rank 2 .* claims tag\(s\) 'gpu-box'"):
        nodes.tags_for(plain, 2, ["cpu", "gpu-box"])
    assert "binds to other node keys" in nodes.tag_problem(None, 3, ["trusted"])
    # ... while free tags stay free, and a revoked line reserves nothing.
    assert nodes.tags_for(plain, 2, ["cpu", "edge"]) == ("cpu", "edge")
    assert nodes.granted_tags(gone) == frozenset()
    (tmp_path / "bad").write_text(wire.public_key_text(gpu) + " tag=a,,b\n")
    with pytest.raises(ConfigError, match="tags must be non-empty names"):
        wire.load_authorized_nodes(tmp_path / "bad")
