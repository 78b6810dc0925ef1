"""A real S3 server for tests: moto in server mode on 127.0.0.1 (a random port), spoken to over
HTTP by the real clients; boto3 looks at what it holds.  ``tests/conftest.py`` makes its fixtures
(``s3_server``, ``s3``) available to every test file; a test without moto or boto3 installed
skips with the reason."""

from __future__ import annotations

import http.client
import uuid

import pytest

KEY, SECRET, REGION = "testing-key", "testing-secret", "us-east-1"


class S3Server:
    def __init__(self):
        moto_server = pytest.importorskip("moto.server", reason="the test extra (moto[server]) is not installed")
        boto3 = pytest.importorskip("boto3", reason="the test extra (boto3) is not installed")
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION
        )

    def new_bucket(self) -> str:
        name = f"rec-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def uploads_in_progress(self, bucket: str) -> list:
        return self.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])

    def require_credentials(self, on: bool) -> None:
        """moto's public switch: check request signatures (unknown keys are refused) or not."""
        conn = http.client.HTTPConnection(*self.server.get_host_and_port())
        conn.request("POST", "/moto-api/reset-auth", body=b"0" if on else b"inf")
        assert conn.getresponse().status == 200


@pytest.fixture(scope="module")
def s3_server():
    """One server per test module (a module may change its state: credentials required, ...)."""
    server = S3Server()
    yield server
    server.server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket (``s3.bucket``); the standard AWS_* variables point at the local server."""
    for var, value in {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": REGION,
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(var, value)
    s3_server.bucket = s3_server.new_bucket()
    return s3_server
