"""Every object storage backend passes actstore.testing's backend kit against a real
server on 127.0.0.1: moto for s3://, fake-gcs-server for gs://, Azurite for az://."""

from __future__ import annotations

import pytest

from actstore.storage.object import MiB, S3Store, open_bucket
from actstore.storage.object.config import AzureConfig, GCSConfig, S3Config
from actstore.testing import BackendSuite

#: What the kit asks of every store: a small listing page, parts over 5 MiB.
PAGE = BackendSuite.page_size
PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


class TestS3Backend(BackendSuite):
    @pytest.fixture
    def object_store(self, s3):
        return S3Store(s3.bucket, S3Config(endpoint_url=s3.endpoint, list_page_size=PAGE, **PARTS))


class TestGCSBackend(BackendSuite):
    @pytest.fixture
    def object_store(self, gcs):
        return open_bucket("gs", gcs.bucket, GCSConfig(list_page_size=PAGE, **PARTS))


class TestAzureBackend(BackendSuite):
    """obstore sets no page size: Azure's listing pages (5000 keys) are not crossed here."""

    @pytest.fixture
    def object_store(self, azure):
        return open_bucket("az", azure.bucket, AzureConfig(**PARTS))
