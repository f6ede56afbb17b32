"""Node identity: Ed25519 key pairs, the files that hold them, and who is authorized.

A node proves it holds its private key by signing the handshake transcript
(the hash of both hellos, which carry both ephemeral X25519 keys), so a
signature is valid for one connection only and binds the key to that
connection's session keys. This module knows the key files and the
``authorized_nodes`` file; the handshake sends and checks the signature, and
the transport decides whether an authenticated key may join.

Files:

* a **private key**: PKCS#8 PEM (``-----BEGIN PRIVATE KEY-----``), mode 0600;
  refused if group or others may access it.
* a **public key** (``KEY.pub``) and each line of ``authorized_nodes``::

      meshkit-ed25519 BASE64-OF-32-BYTES [rank=N[,M...]] [tag=T[,U...]] [comment...]
      revoked meshkit-ed25519 BASE64-OF-32-BYTES [comment...]

  ``#`` starts a comment line. ``rank=`` binds the key to those ranks (a
  node presenting it under another rank is refused); without it the key may
  take any rank. ``tag=`` binds placement tags to the key: the node holding
  it carries those tags whatever it advertises, and a tag bound to any key
  is *reserved* — a node whose key does not carry it may not claim it (as a
  hostname, device or stage id) and is refused. A tag no line binds stays
  free for every admitted node. A ``revoked`` line refuses that key whatever
  else says.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path
from typing import Iterable

import attrs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshkit.errors import AuthenticationError, ConfigError
from meshkit.wire._secrets import check_private_file

#: The first word of a public key line.
KEY_TYPE = "meshkit-ed25519"
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
_SIGN_LABEL = b"meshkit/1 node identity "


def public_key_text(public: bytes, comment: str = "") -> str:
    """``meshkit-ed25519 BASE64 [comment]``: a public key as one line of text."""
    line = f"{KEY_TYPE} {base64.b64encode(public).decode()}"
    return f"{line} {comment}".rstrip()


def fingerprint(public: bytes) -> str:
    """A short printable name for a public key (for logs and errors)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(public).digest()).decode()[:16]


@attrs.frozen(repr=False)
class NodeKey:
    """A node's Ed25519 private key (load with :func:`load_node_key`)."""

    private: Ed25519PrivateKey

    def __repr__(self) -> str:
        return f"<NodeKey {fingerprint(self.public)}>"

    @property
    def public(self) -> bytes:
        return self.private.public_key().public_bytes(serialization.Encoding.Raw,
                                                      serialization.PublicFormat.Raw)

    def sign(self, transcript: bytes, nonce: bytes) -> bytes:
        """Sign one connection's transcript (as the end whose hello carried ``nonce``)."""
        return self.private.sign(_SIGN_LABEL + transcript + nonce)


def verify_signature(public: bytes, signature: bytes, transcript: bytes, nonce: bytes) -> None:
    """Raise :class:`AuthenticationError` unless ``signature`` is ``public``'s over the transcript."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature,
                                                          _SIGN_LABEL + transcript + nonce)
    except (InvalidSignature, ValueError):
        raise AuthenticationError(
            f"node key {fingerprint(public)} failed to prove possession: its signature of "
            "this handshake does not verify (forged or replayed)") from None


def generate_node_key(path: str | os.PathLike[str], *, comment: str = "",
                      overwrite: bool = False) -> bytes:
    """Write a fresh Ed25519 pair: ``path`` (private, 0600) and ``path.pub``; return the public key."""
    path = Path(path)
    pub_path = Path(f"{path}.pub")
    if not overwrite:
        for existing in (path, pub_path):
            if existing.exists():
                raise ConfigError(f"{str(existing)!r} already exists; refusing to replace a key "
                                  "(remove it first, or pass --force)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, pem)
    finally:
        os.close(fd)
    public = NodeKey(key).public
    pub_path.write_text(public_key_text(public, comment) + "\n")
    return public


def load_node_key(path: str | os.PathLike[str], what: str = "--key") -> NodeKey:
    """Read a private key file written by :func:`generate_node_key` (must be mode 0600)."""
    check_private_file(path, what)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{what}: {os.fspath(path)!r} is not an unencrypted PEM private key "
                          f"({exc}); make one with `meshkit keygen`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{what}: {os.fspath(path)!r} holds a {type(key).__name__}, not an "
                          "Ed25519 key; make one with `meshkit keygen`")
    return NodeKey(key)


def parse_public_key(text: str, where: str = "public key") -> bytes:
    """The 32 raw bytes of a ``meshkit-ed25519 BASE64`` line (or of the BASE64 alone)."""
    words = text.split()
    if words and words[0] == KEY_TYPE:
        words = words[1:]
    if not words:
        raise ConfigError(f"{where}: no key (expected `{KEY_TYPE} BASE64`)")
    try:
        raw = base64.b64decode(words[0], validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: {words[0]!r} is not base64") from None
    if len(raw) != PUBLIC_KEY_SIZE:
        raise ConfigError(f"{where}: an Ed25519 public key is {PUBLIC_KEY_SIZE} bytes, this one "
                          f"is {len(raw)}")
    return raw


@attrs.frozen
class AuthorizedKey:
    """One line of ``authorized_nodes``."""

    public: bytes
    #: The ranks this key may take; empty: any.
    ranks: frozenset[int] = frozenset()
    #: The placement tags this key carries (and reserves for itself).
    tags: frozenset[str] = frozenset()
    revoked: bool = False
    comment: str = ""


@attrs.frozen
class AuthorizedNodes:
    """The parsed ``authorized_nodes`` file: which node keys may join, as which rank."""

    path: str
    keys: tuple[AuthorizedKey, ...]

    def problem(self, public: bytes | None, rank: int) -> str | None:
        """Why a node presenting ``public`` (None: no key) may not join as ``rank``, or None."""
        if public is None:
            return (f"no node key: this coordinator admits only nodes listed in its "
                    f"authorized_nodes ({self.path}); start the node with --key FILE "
                    f"(made by `meshkit keygen`)")
        name = fingerprint(public)
        entries = [k for k in self.keys if k.public == public]
        if any(k.revoked for k in entries):
            return f"node key {name} is revoked in {self.path}; this node may not join"
        if not entries:
            return (f"node key {name} is unknown: it is not listed in {self.path}; add its "
                    f".pub line there to admit it")
        if any(not k.ranks or rank in k.ranks for k in entries):
            return None
        bound = sorted({r for k in entries for r in k.ranks})
        return (f"node key {name} is bound to rank {', '.join(map(str, bound))} in "
                f"{self.path}, but the node claims rank {rank}; refused")

    def granted_tags(self, public: bytes | None) -> frozenset[str]:
        """The placement tags bound to ``public`` (none for an unknown or revoked key)."""
        entries = [k for k in self.keys if k.public == public]
        if public is None or any(k.revoked for k in entries):
            return frozenset()
        return frozenset(t for k in entries for t in k.tags)

    def reserved_tags(self) -> frozenset[str]:
        """Every tag bound to a key that is not revoked: only its keys may carry it."""
        revoked = {k.public for k in self.keys if k.revoked}
        return frozenset(t for k in self.keys if k.public not in revoked for t in k.tags)

    def tag_problem(self, public: bytes | None, rank: int,
                    claimed: Iterable[str]) -> str | None:
        """Why rank ``rank`` (key ``public``) may not claim the tags ``claimed``, or None."""
        stolen = sorted((set(claimed) & self.reserved_tags()) - self.granted_tags(public))
        if not stolen:
            return None
        who = f"node key {fingerprint(public)}" if public is not None else "a node without a key"
        return (f"rank {rank} ({who}) claims tag(s) {', '.join(map(repr, stolen))}, which "
                f"{self.path} binds to other node keys; refused (add tag=... to this "
                f"node's line to let it carry them)")

    def tags_for(self, public: bytes | None, rank: int, claimed: Iterable[str]) -> tuple[str, ...]:
        """The tags placement may trust for this node: what it claimed plus what its key carries.

        Raises :class:`AuthenticationError` when it claims a tag reserved for
        other keys (:meth:`tag_problem`).
        """
        claimed = tuple(claimed)
        problem = self.tag_problem(public, rank, claimed)
        if problem is not None:
            raise AuthenticationError(problem)
        extra = sorted(self.granted_tags(public) - set(claimed))
        return claimed + tuple(extra)


def load_authorized_nodes(path: str | os.PathLike[str],
                          what: str = "[mesh] authorized_nodes") -> AuthorizedNodes:
    """Parse an ``authorized_nodes`` file (see the module docstring for the format)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}: cannot read {os.fspath(path)!r}: {exc}") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{what}: {os.fspath(path)}:{number}"
        revoked = words[0] == "revoked"
        if revoked:
            words = words[1:]
        if not words or words[0] != KEY_TYPE:
            raise ConfigError(f"{where}: expected `[revoked] {KEY_TYPE} BASE64 [rank=N] "
                              f"[comment]`, got {line.strip()!r}")
        public = parse_public_key(" ".join(words[:2]), where)
        ranks: set[int] = set()
        tags: set[str] = set()
        rest = words[2:]
        comment = []
        for word in rest:
            if word.startswith("rank="):
                try:
                    ranks.update(int(r) for r in word[5:].split(","))
                except ValueError:
                    raise ConfigError(f"{where}: {word!r}: ranks must be integers, e.g. "
                                      "rank=2 or rank=1,3") from None
            elif word.startswith("tag="):
                names = word[4:].split(",")
                if not all(names):
                    raise ConfigError(f"{where}: {word!r}: tags must be non-empty names, "
                                      "e.g. tag=gpu or tag=gpu,edge")
                tags.update(names)
            else:
                comment.append(word)
        keys.append(AuthorizedKey(public=public, ranks=frozenset(ranks),
                                  tags=frozenset(tags), revoked=revoked,
                                  comment=" ".join(comment)))
    return AuthorizedNodes(path=os.fspath(path), keys=tuple(keys))
