"""The write lock of ``s3://`` stores: defined in :mod:`actstore.storage.object.s3lock`
(beside the S3 store that takes it), importable from here too."""

from .object.s3lock import DEFAULT_LEASE_S, S3Lock

__all__ = ["DEFAULT_LEASE_S", "S3Lock"]
