"""``ddm fetch-data``: MNIST from a private S3 bucket (moto on loopback, IAM on) through the
checkpoint fetcher, checked as ``load_mnist`` reads it before it is put in place."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from ddm.cli import main
from ddm.data.mnist import DISTRIBUTED_FILES, load_mnist
from tests.support.bars_mnist import write_bars_mnist
from tests.support.s3_store import moto_bucket

pytest.importorskip("moto", reason="moto[server] is in the dev extra")


def _distributed(tmp_path: Path) -> dict[str, bytes]:
    raw = tmp_path / "raw"
    for part in ("train", "t10k"):
        write_bars_mnist(raw, part)
    return {name: gzip.compress((raw / name.removesuffix(".gz")).read_bytes(), mtime=0)
            for name in DISTRIBUTED_FILES}


def _tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"mnist/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_directory_and_an_archive_are_fetched_and_a_damaged_copy_is_refused(
        tmp_path, no_cloud_credentials, monkeypatch, capsys):
    files = _distributed(tmp_path)
    damaged = {**files, DISTRIBUTED_FILES[1]: gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x09")}
    objects = {**{f"dir/{name}": data for name, data in files.items()},
               "mnist.tar.gz": _tar(files), "damaged.tar.gz": _tar(damaged)}
    with moto_bucket("datasets", objects) as bucket:
        keys = bucket.credentials_file(tmp_path / "keys", bucket.reader)
        options = ["--allow-network", "127.0.0.1/32", "--store-credentials-file", str(keys)]
        monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.url)
        for uri in ("s3://datasets/dir", "s3://datasets/mnist.tar.gz"):
            dest = tmp_path / uri.rsplit("/", 1)[1]
            assert main(["fetch-data", uri, str(dest), *options]) == 0
            images, labels = load_mnist(dest, 28)
            assert images.shape == (30, 1, 28, 28) and sorted(set(labels)) == list(range(10))
        dest = tmp_path / "damaged"
        assert main(["fetch-data", "s3://datasets/damaged.tar.gz", str(dest), *options]) != 0
        said = capsys.readouterr().err
        assert "the downloaded MNIST data failed verification" in said
        assert "train-labels-idx1-ubyte.gz: truncated data" in said
        assert not dest.exists()
