"""Weights fingerprints: a sha256 over the checkpoint's files, remembered by their file status.

The fingerprint names a model's KV everywhere (the disk store's namespace, Redis keys, the
router's replica check), so it hashes every byte. Hashing Gemma 3's 253 MB took 0.3 s of every
start; the result is kept under the cache root, keyed by each file's path, size, inode and
device, modification and status-change times. Any write to a file changes its status-change
time, which, unlike the modification time, no program can set back: a changed file is hashed
again.

Invariant: fingerprint_files returns the full hash's value whether or not it was remembered; an
unreadable or damaged memo is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import string
from pathlib import Path

from kvmemo.paths import cache_root

logger = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 8 << 20


def fingerprint_files(files: list[Path], root: Path) -> str:
    """sha256 over (relative name, size, bytes) of each file, in the given order."""
    memo = memo_path(files, root)
    try:
        remembered = memo.read_text().strip()
        if len(remembered) == 64 and all(c in string.hexdigits for c in remembered):
            return remembered
    except OSError:
        pass
    fingerprint = hash_files(files, root)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.with_name(f".{memo.name}.{os.getpid()}")
        staging.write_text(fingerprint + "\n")
        os.replace(staging, memo)
    except OSError as e:  # a read-only cache: hashed again next time
        logger.debug("could not remember the fingerprint under %s: %s", memo.parent, e)
    return fingerprint


def hash_files(files: list[Path], root: Path) -> str:
    """The fingerprint itself, every byte read."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(root).as_posix()}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def memo_path(files: list[Path], root: Path) -> Path:
    """Where the fingerprint of exactly these files, as they are now, is remembered."""
    status = []
    for file in files:
        st = file.stat()
        status.append([str(file.resolve()), file.relative_to(root).as_posix(), st.st_size,
                       st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns])
    key = hashlib.sha256(json.dumps(status).encode()).hexdigest()
    return cache_root() / "fingerprints" / key[:2] / key
