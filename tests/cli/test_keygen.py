"""``meshkit keygen``: a private key only its owner can read, and an authorized_nodes line."""

from __future__ import annotations

from meshkit import wire

from conftest import run_cli


def test_keygen_writes_the_pair_and_prints_a_bindable_line(tmp_path):
    key = tmp_path / "node.key"
    result = run_cli("keygen", str(key), "--rank", "2", "--tag", "gpu", "--comment", "lab-1")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    public = wire.load_node_key(key).public
    assert line == f"{wire.public_key_text(public)} rank=2 tag=gpu lab-1"
    assert key.stat().st_mode & 0o777 == 0o600
    assert wire.parse_public_key((tmp_path / "node.key.pub").read_text()) == public
    (tmp_path / "authorized").write_text(line + "\n")
    nodes = wire.load_authorized_nodes(tmp_path / "authorized")
    assert nodes.problem(public, 2) is None and "bound to rank 2" in nodes.problem(public, 1)
    assert nodes.granted_tags(public) == {"gpu"}


def test_keygen_never_replaces_a_key_unless_forced(tmp_path):
    key = tmp_path / "k"
    assert run_cli("keygen", str(key)).returncode == 0
    before = key.read_bytes()
    again = run_cli("keygen", str(key))
    assert again.returncode == 2 and "already exists" in again.stderr
    assert key.read_bytes() == before
    assert run_cli("keygen", str(key), "--force").returncode == 0
    assert key.read_bytes() != before


def test_a_node_refuses_a_key_file_others_can_read(tmp_path):
    key = tmp_path / "k"
    assert run_cli("keygen", str(key)).returncode == 0
    key.chmod(0o644)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    result = run_cli("node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9",
                     "--secret-file", str(secret), "--key", str(key))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--key" in result.stderr and "chmod 600" in result.stderr


def test_the_pub_file_keeps_the_rank_binding_so_cat_builds_the_authorized_file(tmp_path):
    for rank in (1, 2):
        result = run_cli("keygen", str(tmp_path / f"node{rank}.key"), "--rank", str(rank))
        assert result.returncode == 0, result.stderr
        assert (tmp_path / f"node{rank}.key.pub").read_text() == result.stdout
    # cat keys/*.pub > authorized
    (tmp_path / "authorized").write_text(
        "".join(p.read_text() for p in sorted(tmp_path.glob("*.pub"))))
    nodes = wire.load_authorized_nodes(tmp_path / "authorized")
    one = wire.load_node_key(tmp_path / "node1.key").public
    assert nodes.problem(one, 1) is None
    assert "bound to rank 1" in nodes.problem(one, 2)
