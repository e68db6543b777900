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
from .object import LocalStore, ObjectStore, S3Config, S3Store, open_location

__all__ = [
    "FileHasher",
    "LocalStore",
    "ObjectStore",
    "S3Config",
    "S3Store",
    "atomic_write_bytes",
    "atomic_write_json",
    "fsync_dir",
    "hash_file",
    "make_read_only",
    "open_location",
    "publish_dir",
    "read_json",
]
