"""The checkpoint store on an S3-compatible service (`S3Store`): a bucket and a key prefix in it, through
boto3 (imported when a store is made: a gateway that keeps its checkpoints in a directory needs none).
`sandbox.checkpoint_store.store_for` makes one from an ``s3://`` URL."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from core.errors import (
    CheckpointError,
    CheckpointMissing,
    CheckpointUnreadable,
    SandboxArgumentError,
)
from sandbox.checkpoint_store import CheckpointStore, check_key, redacted

_S3_MISSING = {"404", "NoSuchKey", "NotFound"}
"""The error codes of a missing object (a HEAD answers a bare 404)."""


class S3Store(CheckpointStore):
    """A bucket (and a key prefix in it) of any S3-compatible service. Credentials come from boto3's usual
    sources (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, an instance role). Big objects go
    in multipart uploads, which S3 shows only once complete. With `create_bucket`, a missing bucket is
    created; otherwise using one raises an error that says so."""

    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None,
        *, create_bucket: bool = False,
    ) -> None:  # fmt: skip
        import boto3
        from botocore.config import Config

        if endpoint_url and "@" in urlsplit(endpoint_url).netloc:
            # it would show in every error, in describe(), and in each checkpoint's recorded location
            raise SandboxArgumentError(
                f"checkpoint store endpoint {redacted(endpoint_url)!r} carries a user name or password: give "
                "the endpoint without them, and the credentials as AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or a profile)"
            )
        self.bucket, self.prefix = bucket, check_key(prefix, prefix=True)
        self.endpoint_url, self.region = endpoint_url, region
        # Another service than AWS: path-style addresses (no DNS per bucket), and checksums only where the
        # API requires them (boto3 >= 1.36 adds them to every request; many S3-compatible services refuse).
        extra: dict[str, Any] = {}
        if endpoint_url:
            extra = {"s3": {"addressing_style": "path"}, "request_checksum_calculation": "when_required",
                     "response_checksum_validation": "when_required"}  # fmt: skip
        config = Config(retries={"mode": "standard", "max_attempts": 5}, **extra)
        session = boto3.session.Session()  # its own: boto3's default session is not thread-safe
        self._client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        if create_bucket:
            self._create_bucket()

    @property
    def url(self) -> str:
        query = "&".join(
            f"{name}={quote(value, safe=':/')}"
            for name, value in (("endpoint", self.endpoint_url), ("region", self.region)) if value
        )  # fmt: skip
        return f"s3://{self.bucket}/{self.prefix}" + (f"?{query}" if query else "")

    def describe(self) -> str:
        where = self.endpoint_url or "AWS"
        return f"S3 bucket {self.bucket!r}, prefix {self.prefix!r}, at {where} (region {self.region or 'default'})"

    def put_file(self, key: str, source: Path) -> None:
        source.stat()  # the caller's own file: its OSError, not the store's
        with self._errors(key, reading=False):
            self._client.upload_file(str(source), self.bucket, self._name(key))

    def get_file(self, key: str, dest: Path) -> None:
        # s3transfer writes a temporary file next to `dest` and renames it when complete.
        with self._errors(key, reading=True):
            self._client.download_file(self.bucket, self._name(key), str(dest))

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(key, reading=False):
            self._client.put_object(Bucket=self.bucket, Key=self._name(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        with self._errors(key, reading=True):
            return bytes(self._client.get_object(Bucket=self.bucket, Key=self._name(key))["Body"].read())

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key, reading=True):
                self._client.head_object(Bucket=self.bucket, Key=self._name(key))
        except CheckpointMissing:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        folder = self._folder(prefix)
        with self._errors(prefix, reading=False, what="list"):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder)
            names = [obj["Key"] for page in pages for obj in page.get("Contents", ())]
        start = len(self._folder(""))
        return sorted(name[start:] for name in names)

    def delete_prefix(self, prefix: str) -> int:
        keys, removed = self.list(prefix), 0
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            batch = [{"Key": self._name(k)} for k in keys[i : i + 1000]]
            with self._errors(prefix, reading=False, what="delete"):
                answer = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise CheckpointError(f"checkpoint store {self.url}: cannot delete {first.get('Key')!r}"
                                      f" ({first.get('Code')}: {first.get('Message')})")  # fmt: skip
            removed += len(batch)
        return removed

    def close(self) -> None:
        self._client.close()

    def _name(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, check_key(key)) if p)

    def _folder(self, prefix: str) -> str:
        name = "/".join(p for p in (self.prefix, check_key(prefix, prefix=True)) if p)
        return name + "/" if name else ""

    def _create_bucket(self) -> None:
        with self._errors(self.bucket, reading=False, what="create bucket"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return
            except self._client.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in _S3_MISSING | {"NoSuchBucket"}:
                    raise
            where = {} if self.region in (None, "us-east-1") else {"LocationConstraint": self.region}
            with contextlib.suppress(self._client.exceptions.BucketAlreadyOwnedByYou):
                self._client.create_bucket(
                    Bucket=self.bucket, **({"CreateBucketConfiguration": where} if where else {})
                )

    @contextlib.contextmanager
    def _errors(self, key: str, *, reading: bool, what: str = "write") -> Iterator[None]:
        """The one place where boto3's errors become the sandbox's."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if reading and code in _S3_MISSING:
                raise self._missing(key) from exc
            if code == "NoSuchBucket":
                raise (CheckpointUnreadable if reading else CheckpointError)(
                    f"checkpoint store {self.url}: bucket {self.bucket!r} does not exist: create it, or "
                    "build the store with create_bucket=True"
                ) from exc
            raise self._failed(key, exc, "read" if reading else what) from exc
        except (BotoCoreError, Boto3Error) as exc:
            raise self._failed(key, exc, "read" if reading else what) from exc
