"""Bytes on local disk and object storage: atomic publish, checksums, URLs."""

from .local import (
    FileHasher,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    hash_file,
    link_or_copy,
    make_tree_read_only,
    read_json,
    remove_tree,
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
    "link_or_copy",
    "make_tree_read_only",
    "open_location",
    "read_json",
    "remove_tree",
]
