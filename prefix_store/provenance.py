"""Provenance: which stored KV a decoder may verify against (docs/DESIGN.md section 8).

Losslessness needs the verifier's full KV to be the model's own exact KV for the prompt's
tokens. The store is also a plain KV store that any tenant can write through the SDK, so
bytes in it prove nothing by themselves. A deployment therefore has one Ed25519 key pair:

- decoders hold the private key and sign what they compute. A chunk's *statement* binds
  the model and KV layout, a SHA-256 of every token from the start of the prefix to the
  chunk's end (a chunk's KV depends on all of them, not only on its own tokens) and a
  BLAKE3 hash of the chunk's stored bytes (its *digest*; `content_hasher`);
- shards hold the public key: they compute the digest of what they received, refuse a put
  whose signature does not verify, keep the signature beside the chunk, answer each hit
  of a lookup with its proof (digest, signature), and serve a fetch that names a digest
  only from a chunk with that digest;
- decoders check every proof at lookup, with the public key, and use only the leading
  chunks that verify (`trusted_prefix`); the rest of the prompt is recomputed exactly.

A chunk without a valid signature is *unsigned*: a plain KV-store entry that the SDK can
read back, never a verifier input. A signed put replaces an unsigned chunk of the same key;
an unsigned put never replaces a signed one.

Artifacts (compressed KV, draft inputs only: they change speed, never tokens) are signed
over (layout, prefix key, prefix length, compressor spec, digest of the bytes), which the
shard can check without the prefix's tokens.

The digest is BLAKE3 (256 bits), not SHA-256: shards hash every byte a put brings, on the
put's path, and SHA-256 runs at about 1.1-1.3 GB/s a core even with SHA-NI, below what a
shard receives; BLAKE3 runs at about 4 GB/s a core. Statements are versioned (`v2`, the
BLAKE3 digest; `v1` was SHA-256), so a proof made under one never verifies as the other,
and a shard treats a chunk it kept from v1 as unsigned (`PROOF_FORMAT`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import blake3
import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from prefix_store.errors import InvalidArgument
from prefix_store.layout import KVLayout

SIGNATURE_BYTES = 64
DIGEST_BYTES = 32
KEY_BYTES = 32
PROOF_FORMAT = 2
"""The statements' version (and digest: 2 = BLAKE3), kept with each stored proof: a blob
whose proof has another format is unsigned to the shard."""


@dataclass(frozen=True, slots=True)
class Proof:
    """What a shard holds about a chunk's origin: the digest of its stored bytes and the
    signature a decoder made over its statement (b"" when unsigned)."""

    digest: bytes = b""
    signature: bytes = b""


def content_hasher():
    """A fresh digest of stored bytes (BLAKE3-256, one thread): `update(buffer)` as the bytes
    come, `digest()` at the end."""
    return blake3.blake3(max_threads=1)


def content_digest(segments) -> bytes:
    """The digest of buffers back to back (a chunk's layer-major stored bytes)."""
    h = content_hasher()
    for segment in segments:
        h.update(segment)
    return h.digest()


def token_digests(token_ids: Sequence[int], ends: Sequence[int]) -> list[bytes]:
    """SHA-256 of the tokens [0, end) for each end, in one pass over the tokens."""
    ids = np.asarray(token_ids, dtype="<u4")
    h, done, found = hashlib.sha256(), 0, {}
    for end in sorted(set(ends)):
        h.update(ids[done:end].tobytes())
        done = end
        found[end] = h.copy().digest()
    return [found[end] for end in ends]


def _layout_bytes(layout: KVLayout) -> bytes:
    return "\x1f".join(str(part) for part in layout.identity()).encode()


def chunk_statement(layout: KVLayout, tokens_digest: bytes, digest: bytes) -> bytes:
    return b"vericache/kv-chunk/v2\0" + _layout_bytes(layout) + b"\0" + tokens_digest + digest


def artifact_statement(
    layout: KVLayout, prefix_key: int, prefix_tokens: int, spec: str, digest: bytes
) -> bytes:
    head = f"\0{prefix_key:016x}\0{prefix_tokens}\0{spec}\0".encode()
    return b"vericache/artifact/v2\0" + _layout_bytes(layout) + head + digest


class Verifier:
    """Checks statements with a deployment's public key (what shards and decoders hold)."""

    def __init__(self, public_key: bytes) -> None:
        if len(public_key) != KEY_BYTES:
            raise InvalidArgument(f"provenance public key: {KEY_BYTES} bytes expected")
        self.public_bytes = bytes(public_key)
        self._key = Ed25519PublicKey.from_public_bytes(self.public_bytes)

    def verify(self, statement: bytes, signature: bytes) -> bool:
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            self._key.verify(signature, statement)
        except InvalidSignature:
            return False
        return True


class Signer:
    """Signs statements with a deployment's private key (what decoders alone hold)."""

    def __init__(self, private_key: bytes) -> None:
        if len(private_key) != KEY_BYTES:
            raise InvalidArgument(f"provenance private key: {KEY_BYTES} bytes expected")
        self._key = Ed25519PrivateKey.from_private_bytes(bytes(private_key))
        public = self._key.public_key().public_bytes_raw()
        self.verifier = Verifier(public)

    @classmethod
    def generate(cls) -> Signer:
        return cls(os.urandom(KEY_BYTES))

    @property
    def private_bytes(self) -> bytes:
        return self._key.private_bytes_raw()

    def sign(self, statement: bytes) -> bytes:
        return self._key.sign(statement)


def load_or_create_key(path: Path) -> Signer:
    """The deployment's key at `path` (32 raw bytes, mode 0600), created when absent."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        signer = Signer.generate()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(signer.private_bytes)
        return signer
    return Signer(path.read_bytes())


def read_key(path: Path) -> Signer:
    """The deployment's key from `path` on this host; a clear error when it is missing
    (`ray up` copies it from the head) or readable by others than its owner."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(
            f"provenance key {path} missing on this host: copy the head's "
            "(`ray up` does, with cluster_synced_files)"
        ) from None
    if mode & 0o077:
        raise PermissionError(f"provenance key {path} is readable by others: chmod 600 it")
    return Signer(path.read_bytes())


def check_chunk(
    verifier: Verifier | None, layout: KVLayout, tokens_digest: bytes, proof: Proof
) -> bool:
    """Whether `proof` shows the chunk is the model's own KV for those tokens."""
    if verifier is None or len(proof.digest) != DIGEST_BYTES or not proof.signature:
        return False
    return verifier.verify(chunk_statement(layout, tokens_digest, proof.digest), proof.signature)


def trusted_prefix(prefix, token_ids: Sequence[int], verifier: Verifier):
    """The leading chunks of a looked-up `CachedPrefix` whose proofs verify: what a decoder
    may hand its verifier. A prefix whose first chunk does not verify becomes a miss."""
    chunks = prefix.chunks
    ends = [c.start + c.tokens for c in chunks]
    digests = token_digests(token_ids, ends)
    kept = 0
    for chunk, tokens_digest in zip(chunks, digests, strict=True):
        if not check_chunk(verifier, prefix.layout, tokens_digest, chunk.proof):
            break
        kept += 1
    if kept == len(chunks):
        return prefix
    return replace(prefix, tokens=sum(c.tokens for c in chunks[:kept]), chunks=chunks[:kept])
