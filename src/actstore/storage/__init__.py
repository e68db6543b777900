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
from .object import (
    AzureConfig,
    GCSConfig,
    LocalStore,
    ObjectStore,
    S3Config,
    S3Store,
    StorageOptions,
    open_location,
)

__all__ = [
    "AzureConfig",
    "FileHasher",
    "GCSConfig",
    "LocalStore",
    "ObjectStore",
    "S3Config",
    "S3Store",
    "StorageOptions",
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
