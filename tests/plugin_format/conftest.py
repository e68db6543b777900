# The conformance kit's pytest plugin: the S3 server its S3 rule needs, and the rest.
pytest_plugins = ["actstore.testing.plugin"]
