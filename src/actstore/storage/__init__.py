"""Bytes on local disk and object storage: atomic publish, checksums, URLs."""

from .local import (
    FileHasher,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    hash_file,
    make_read_only,
    publish_dir,
    read_json,
)

__all__ = [
    "FileHasher",
    "atomic_write_bytes",
    "atomic_write_json",
    "fsync_dir",
    "hash_file",
    "make_read_only",
    "publish_dir",
    "read_json",
]
