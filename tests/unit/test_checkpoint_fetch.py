"""``ddm fetch-checkpoint``: a real HTTP server on loopback serves a real smoke checkpoint.

The server plays a web server, an S3 endpoint and a GCS emulator (the same paths), and can be
told to fail a path a number of times (a status, a dropped body, or a stalled answer), so the
retry, timeout, verification and atomicity promises are checked against real sockets.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ddm.checkpoints.destinations import parse_networks
from ddm.checkpoints.archive import MAX_ARCHIVE_HEADER_BYTES
from ddm.checkpoints.fetch import FetchError, FetchPolicy, fetch_checkpoint, resolve_url
from ddm.checkpoints.format import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint
from ddm.checkpoints.uri import FETCH_COMMAND
from ddm.cli import main

#: The loopback server's one address: the only non-public destination these fetches may reach.
LOOPBACK = parse_networks(["127.0.0.1/32"])
#: Short waits so failures are quick; three attempts per file.
FAST = FetchPolicy(timeout_s=5.0, attempts=3, backoff_s=0.01, allowed_networks=LOOPBACK)
ALLOW_LOOPBACK = ["--allow-network", "127.0.0.1/32"]
#: The CLI runs here: its termination message goes to a temporary file, never the host's /dev.
pytestmark = pytest.mark.usefixtures("termination_log")
DROP = "drop"    # send the headers and half the body, then close the connection
STALL = "stall"  # answer nothing until the test ends


class Origin:
    """What the loopback server serves: ``files`` by path, after ``failures`` for that path."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.failures: dict[str, list[int | str]] = {}
        self.requests: list[str] = []
        self.release = threading.Event()
        self.url = ""


def _handler(origin: Origin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            origin.requests.append(self.path)
            path = self.path.partition("?")[0]  # a pre-signed URL's query names the same file
            pending = origin.failures.get(path)
            failure = pending.pop(0) if pending else None
            body = origin.files.get(path)
            if failure == STALL:
                origin.release.wait(10)
                return
            if isinstance(failure, int):
                self.send_error(failure)
                return
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2] if failure == DROP else body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def origin() -> Iterator[Origin]:
    served = Origin()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(served))
    server.daemon_threads = True
    served.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


def _serve_directory(origin: Origin, prefix: str, checkpoint: Path) -> None:
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        origin.files[f"{prefix}/{name}"] = (checkpoint / name).read_bytes()


def _archive(build: Callable[[tarfile.TarFile], None], mode: str = "w:gz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        build(tar)
    return buffer.getvalue()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, kind: bytes = tarfile.REGTYPE,
               link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _assert_same_checkpoint(dest: Path, source: Path) -> None:
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name
    assert load_checkpoint(dest).meta.name == "smoke-torch"


def _assert_nothing_left(parent: Path) -> None:
    """A failed fetch leaves no destination and no staging directory behind."""
    assert sorted(p.name for p in parent.iterdir()) == []


# -- where checkpoints come from -------------------------------------------------------------

def test_a_checkpoint_directory_url_is_fetched_and_verified(origin, smoke_expert_checkpoint,
                                                            tmp_path):
    _serve_directory(origin, "/models/smoke", smoke_expert_checkpoint)
    dest = fetch_checkpoint(f"{origin.url}/models/smoke/", tmp_path / "out" / "expert", FAST)
    assert dest == tmp_path / "out" / "expert"
    _assert_same_checkpoint(dest, smoke_expert_checkpoint)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["expert"]  # no staging left


@pytest.mark.parametrize("name, mode, top", [("smoke.tar.gz", "w:gz", "smoke-torch/"),
                                             ("smoke.tgz", "w:gz", ""),
                                             ("smoke.tar", "w", "")])
def test_an_archive_of_the_directory_is_fetched_and_verified(origin, smoke_expert_checkpoint,
                                                             tmp_path, name, mode, top):
    def build(tar: tarfile.TarFile) -> None:
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            tar.add(smoke_expert_checkpoint / file, arcname=top + file)

    origin.files[f"/{name}"] = _archive(build, mode)
    dest = fetch_checkpoint(f"{origin.url}/{name}", tmp_path / "expert", FAST)
    _assert_same_checkpoint(dest, smoke_expert_checkpoint)
    assert sorted(p.name for p in dest.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]  # no archive


def _stage_archive(tmp_path: Path, corrupt: bool = False) -> bytes:
    """An archive of a stage checkpoint (a text DDM's decoder, as ``ddm import`` writes one):
    the library's config.json with ``_ddm`` (the weights' SHA-256), its weights file, a
    tokenizer-like extra file."""
    stage = _stage_directory(tmp_path, corrupt)
    return _archive(lambda tar: tar.add(stage, arcname="decoder"))


def _stage_directory(tmp_path: Path, corrupt: bool = False) -> Path:
    from safetensors.numpy import save_file

    stage = tmp_path / "decoder"
    stage.mkdir()
    save_file({"conv.weight": np.ones((2, 2), np.float16)},
              str(stage / "diffusion_pytorch_model.safetensors"))
    (stage / "notes.json").write_text("{}")
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in stage.iterdir()}
    (stage / CONFIG_FILE).write_text(json.dumps({
        "_class_name": "AutoencoderKL", "latent_channels": 4,
        "_ddm": {"role": "decoder", "family": "autoencoder-kl",
                 "weights_sha256": files["diffusion_pytorch_model.safetensors"],
                 "files": {**files, **({"notes.json": "0" * 64} if corrupt else {})}}}))
    return stage


def test_a_stage_checkpoint_archive_is_fetched_and_verified_by_its_declaration(
        origin, tmp_path):
    origin.files["/paris/decoder.tar.gz"] = _stage_archive(tmp_path)
    dest = fetch_checkpoint(f"{origin.url}/paris/decoder.tar.gz", tmp_path / "out", FAST)
    assert sorted(p.name for p in dest.iterdir()) == [
        CONFIG_FILE, "diffusion_pytorch_model.safetensors", "notes.json"]


def test_a_stage_checkpoint_directory_is_fetched_file_by_file_as_declared(origin, tmp_path):
    """As the stager hands a staged checkpoint to the DDM's pods: a directory URI."""
    stage = _stage_directory(tmp_path)
    for path in stage.iterdir():
        origin.files[f"/staged/decoder/{path.name}"] = path.read_bytes()
    dest = fetch_checkpoint(f"{origin.url}/staged/decoder", tmp_path / "out", FAST)
    for path in stage.iterdir():
        assert (dest / path.name).read_bytes() == path.read_bytes()


def test_a_stage_checkpoint_with_an_undeclared_file_is_refused(origin, tmp_path):
    stage = _stage_directory(tmp_path)
    (stage / "extra.py").write_text("print('hello')")
    origin.files["/paris/decoder.tar.gz"] = _archive(lambda tar: tar.add(stage, "decoder"))
    (tmp_path / "out").mkdir()
    with pytest.raises(FetchError, match=r"holds \[.*'extra.py'.*\]; its config.json's _ddm "
                                         r"lists"):
        fetch_checkpoint(f"{origin.url}/paris/decoder.tar.gz", tmp_path / "out" / "d", FAST)
    _assert_nothing_left(tmp_path / "out")


def test_a_stage_checkpoint_whose_files_differ_from_its_declaration_is_refused(
        origin, tmp_path):
    origin.files["/paris/decoder.tar.gz"] = _stage_archive(tmp_path, corrupt=True)
    (tmp_path / "out").mkdir()
    with pytest.raises(FetchError, match=r"failed verification.*notes.json is corrupt"):
        fetch_checkpoint(f"{origin.url}/paris/decoder.tar.gz", tmp_path / "out" / "d", FAST)
    _assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("uri, env", [
    ("s3://ddm-checkpoints/digits/expert-4-6", {"AWS_ENDPOINT_URL": "{url}"}),
    ("s3://ddm-checkpoints/digits/expert-4-6", {"AWS_ENDPOINT_URL_S3": "{url}/",
                                                "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}),
    ("gs://ddm-checkpoints/digits/expert-4-6", {"STORAGE_EMULATOR_HOST": "{host}"}),
])
def test_bucket_uris_go_through_their_endpoint_overrides(origin, smoke_expert_checkpoint,
                                                         tmp_path, uri, env):
    _serve_directory(origin, "/ddm-checkpoints/digits/expert-4-6", smoke_expert_checkpoint)
    host = origin.url.removeprefix("http://")
    env = {k: v.format(url=origin.url, host=host) for k, v in env.items()}
    dest = fetch_checkpoint(uri, tmp_path / "expert", FAST, env=env)
    _assert_same_checkpoint(dest, smoke_expert_checkpoint)


def test_bucket_uris_map_to_the_public_https_endpoints():
    assert resolve_url("s3://b/k/x y", {}) == "https://b.s3.amazonaws.com/k/x%20y"
    assert resolve_url("s3://b/k", {"AWS_REGION": "eu-west-1"}) == \
        "https://b.s3.eu-west-1.amazonaws.com/k"
    assert resolve_url("gs://b/k/m", {}) == "https://storage.googleapis.com/b/k/m"
    assert resolve_url("https://h/p?sig=1", {"AWS_ENDPOINT_URL": "http://x"}) == "https://h/p?sig=1"


def test_the_cli_fills_an_existing_mount_point(origin, smoke_expert_checkpoint, tmp_path,
                                               capsys):
    mount_point = tmp_path / "models" / "expert"
    mount_point.mkdir(parents=True)  # an emptyDir mount point: it exists and cannot be renamed
    _serve_directory(origin, "/smoke", smoke_expert_checkpoint)
    assert main([*FETCH_COMMAND[1:], f"{origin.url}/smoke", str(mount_point),
                 *ALLOW_LOOPBACK]) == 0
    _assert_same_checkpoint(mount_point, smoke_expert_checkpoint)
    assert sorted(p.name for p in mount_point.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert f"fetched {origin.url}/smoke into {mount_point}" in capsys.readouterr().out


def test_a_rerun_replaces_the_checkpoint_a_previous_run_left(origin, smoke_expert_checkpoint,
                                                             tmp_path):
    dest = tmp_path / "expert"
    dest.mkdir()
    (dest / CONFIG_FILE).write_text("{}")
    (dest / "stale.bin").write_bytes(b"old")
    (dest / ".ddm-fetch-interrupted").mkdir()  # what a killed run leaves
    _serve_directory(origin, "/smoke", smoke_expert_checkpoint)
    fetch_checkpoint(f"{origin.url}/smoke", dest, FAST)
    _assert_same_checkpoint(dest, smoke_expert_checkpoint)
    assert sorted(p.name for p in dest.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]


def test_a_directory_holding_something_else_is_never_overwritten(origin, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FetchError, match=r"is not empty and holds no checkpoint \(notes.txt\)"):
        fetch_checkpoint(f"{origin.url}/smoke", tmp_path, FAST)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert origin.requests == []


# -- failures: a clear message and no destination ----------------------------------------------

def test_not_found_names_the_uri_and_leaves_no_destination(origin, tmp_path):
    uri = f"{origin.url}/missing"
    with pytest.raises(FetchError) as caught:
        fetch_checkpoint(uri, tmp_path / "expert", FAST)
    assert str(caught.value).startswith(f"{uri}: ")
    assert "HTTP 404" in str(caught.value) and "nothing at this URL" in str(caught.value)
    _assert_nothing_left(tmp_path)
    assert len(origin.requests) == 1  # a 404 is not retried


def test_a_private_object_says_how_to_reach_it(origin, smoke_expert_checkpoint, tmp_path,
                                               no_cloud_credentials):
    _serve_directory(origin, "/private/smoke", smoke_expert_checkpoint)
    origin.failures["/private/smoke/weights.safetensors"] = [403]
    with pytest.raises(FetchError, match=r"s3://private/smoke: .*HTTP 403.*--headers-file.*"
                                         r"pre-signed"):
        fetch_checkpoint("s3://private/smoke", tmp_path / "expert", FAST,
                         env={"AWS_ENDPOINT_URL": origin.url})
    _assert_nothing_left(tmp_path)


def test_corrupted_weights_fail_verification_and_leave_no_destination(
        origin, smoke_expert_checkpoint, tmp_path):
    _serve_directory(origin, "/smoke", smoke_expert_checkpoint)
    weights = bytearray(origin.files["/smoke/weights.safetensors"])
    weights[-1] ^= 0xFF
    origin.files["/smoke/weights.safetensors"] = bytes(weights)
    with pytest.raises(FetchError, match=r"/smoke: the downloaded checkpoint failed verification"
                                         r".*weights.safetensors is corrupt \(sha256"):
        fetch_checkpoint(f"{origin.url}/smoke", tmp_path / "expert", FAST)
    _assert_nothing_left(tmp_path)


def test_transient_failures_are_retried(origin, smoke_expert_checkpoint, tmp_path):
    _serve_directory(origin, "/smoke", smoke_expert_checkpoint)
    origin.failures["/smoke/weights.safetensors"] = [503, 503]
    origin.failures["/smoke/config.json"] = [DROP]
    dest = fetch_checkpoint(f"{origin.url}/smoke", tmp_path / "expert", FAST)
    _assert_same_checkpoint(dest, smoke_expert_checkpoint)
    assert origin.requests.count("/smoke/weights.safetensors") == 3
    assert origin.requests.count("/smoke/config.json") == 2


def test_retries_are_bounded(origin, smoke_expert_checkpoint, tmp_path):
    _serve_directory(origin, "/smoke", smoke_expert_checkpoint)
    origin.failures["/smoke/weights.safetensors"] = [500] * 10
    with pytest.raises(FetchError, match=r"HTTP 500 .*gave up after 3 attempts"):
        fetch_checkpoint(f"{origin.url}/smoke", tmp_path / "expert", FAST)
    assert origin.requests.count("/smoke/weights.safetensors") == 3
    _assert_nothing_left(tmp_path)


def test_a_silent_server_times_out(origin, smoke_expert_checkpoint, tmp_path):
    _serve_directory(origin, "/smoke", smoke_expert_checkpoint)
    origin.failures["/smoke/weights.safetensors"] = [STALL, STALL]
    policy = FetchPolicy(timeout_s=0.2, attempts=2, backoff_s=0.01, allowed_networks=LOOPBACK)
    with pytest.raises(FetchError, match=r"timed out.*gave up after 2 attempts"):
        fetch_checkpoint(f"{origin.url}/smoke", tmp_path / "expert", policy)
    _assert_nothing_left(tmp_path)


def test_downloads_over_the_size_limit_are_refused(origin, smoke_expert_checkpoint, tmp_path):
    _serve_directory(origin, "/smoke", smoke_expert_checkpoint)
    size = (smoke_expert_checkpoint / WEIGHTS_FILE).stat().st_size
    config = len(origin.files["/smoke/config.json"])  # fetched first, within the same budget
    policy = FetchPolicy(timeout_s=5.0, attempts=1, max_bytes=size - 1,
                         allowed_networks=LOOPBACK)
    with pytest.raises(FetchError, match=rf"is {size} bytes, over the {size - 1 - config}-byte "
                                         "limit"):
        fetch_checkpoint(f"{origin.url}/smoke", tmp_path / "expert", policy)
    _assert_nothing_left(tmp_path)


def test_an_archive_that_inflates_past_the_limit_is_refused(origin, tmp_path):
    origin.files["/bomb.tar.gz"] = _archive(
        lambda tar: _add_bytes(tar, "weights.safetensors", bytes(1 << 20)))
    size = len(origin.files["/bomb.tar.gz"])
    policy = FetchPolicy(timeout_s=5.0, attempts=1, max_bytes=size + 4096,
                         allowed_networks=LOOPBACK)
    with pytest.raises(FetchError, match=r"archive member weights.safetensors: the archive "
                                         r"inflates to more than"):
        fetch_checkpoint(f"{origin.url}/bomb.tar.gz", tmp_path / "expert", policy)
    _assert_nothing_left(tmp_path)


def test_headers_count_against_the_limit_before_any_member_is_read(origin, tmp_path):
    # a pax header of 900 kB of records for one empty file: tarfile reads it whole first
    info = tarfile.TarInfo("config.json")
    info.pax_headers = {"comment": "x" * (900 << 10)}
    origin.files["/headers.tar.gz"] = _archive(lambda tar: tar.addfile(info, io.BytesIO()))
    size = len(origin.files["/headers.tar.gz"])
    policy = FetchPolicy(timeout_s=5.0, attempts=1, max_bytes=size + (64 << 10),
                         allowed_networks=LOOPBACK)
    with pytest.raises(FetchError, match=r"the archive inflates to more than the \d+-byte "
                                         r"limit left for this checkpoint$"):
        fetch_checkpoint(f"{origin.url}/headers.tar.gz", tmp_path / "expert", policy)
    _assert_nothing_left(tmp_path)


@pytest.mark.parametrize("member, build, problem", [
    ("/etc/evil", lambda t: _add_bytes(t, "/etc/evil", b"x"), "outside the checkpoint"),
    ("../evil", lambda t: _add_bytes(t, "../evil", b"x"), "outside the checkpoint"),
    ("ckpt/../../evil", lambda t: _add_bytes(t, "ckpt/../../evil", b"x"),
     "outside the checkpoint"),
    ("config.json", lambda t: _add_bytes(t, "config.json", b"", tarfile.SYMTYPE, "/etc/passwd"),
     "is a link"),
    ("weights.safetensors",
     lambda t: _add_bytes(t, "weights.safetensors", b"", tarfile.LNKTYPE, "../../evil"),
     "is a link"),
    ("tty", lambda t: _add_bytes(t, "tty", b"", tarfile.CHRTYPE), "is a special file"),
    ("pipe", lambda t: _add_bytes(t, "pipe", b"", tarfile.FIFOTYPE), "is a special file"),
    ("sparse", lambda t: _add_bytes(t, "sparse", b"", tarfile.GNUTYPE_SPARSE),
     "is a GNU sparse file"),
    ("contiguous", lambda t: _add_bytes(t, "contiguous", b"", tarfile.CONTTYPE),
     "is a special file"),
])
def test_hostile_archive_members_are_rejected(origin, tmp_path, member, build, problem):
    origin.files["/hostile.tar.gz"] = _archive(build)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(FetchError, match=rf"archive member '{member}'.*{problem}"):
        fetch_checkpoint(f"{origin.url}/hostile.tar.gz", work / "expert", FAST)
    _assert_nothing_left(work)
    assert [p.name for p in tmp_path.iterdir()] == ["work"]  # nothing escaped either


def _file_then_directory(tar: tarfile.TarFile) -> None:
    _add_bytes(tar, "a", b"x")
    _add_bytes(tar, "a/b", b"y")


def _directory_then_file(tar: tarfile.TarFile) -> None:
    _add_bytes(tar, "a/b", b"y")
    _add_bytes(tar, "a", b"x")


def _file_then_deeper_file(tar: tarfile.TarFile) -> None:
    _add_bytes(tar, "a", b"x")
    _add_bytes(tar, "a/b/c", b"y")


def _file_then_directory_member(tar: tarfile.TarFile) -> None:
    _add_bytes(tar, "ckpt/a", b"x")
    _add_bytes(tar, "ckpt/a", b"", tarfile.DIRTYPE)


def _file_twice(tar: tarfile.TarFile) -> None:
    _add_bytes(tar, "ckpt/config.json", b"{}")
    _add_bytes(tar, "ckpt/config.json", b"{}")


@pytest.mark.parametrize("build, problem", [
    (_file_then_directory, "the archive holds 'a' both as a file and as a directory"),
    (_directory_then_file, "the archive holds 'a' both as a file and as a directory"),
    (_file_then_deeper_file, "the archive holds 'a' both as a file and as a directory"),
    (_file_then_directory_member,
     "the archive holds 'ckpt/a' both as a file and as a directory"),
    (_file_twice, "the archive holds the file 'ckpt/config.json' twice"),
])
def test_an_archive_whose_paths_clash_is_refused_naming_the_path(origin, tmp_path, build,
                                                                 problem):
    origin.files["/clash.tar"] = _archive(build, "w")
    with pytest.raises(FetchError, match=f"{problem}$"):
        fetch_checkpoint(f"{origin.url}/clash.tar", tmp_path / "expert", FAST)
    _assert_nothing_left(tmp_path)


@pytest.mark.parametrize("archive_format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["gnu", "pax"])
def test_long_member_names_are_read_from_their_extended_headers(
        origin, smoke_expert_checkpoint, tmp_path, archive_format):
    top = "checkpoint-" + "x" * 200 + "/"  # past ustar's 100 characters: an extended header
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=archive_format) as tar:
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            tar.add(smoke_expert_checkpoint / file, arcname=top + file)
    origin.files["/long.tar.gz"] = buffer.getvalue()
    dest = fetch_checkpoint(f"{origin.url}/long.tar.gz", tmp_path / "expert", FAST)
    _assert_same_checkpoint(dest, smoke_expert_checkpoint)


def _extended_header(kind: bytes, claimed: int) -> bytes:
    """An archive of one extended header (a GNU long name or a pax header) that claims
    ``claimed`` bytes of data and holds none: 512 bytes."""
    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = kind, claimed
    return info.tobuf(format=tarfile.GNU_FORMAT)  # sizes past 8 GiB: base-256


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE],
                         ids=["gnu-long-name", "pax"])
@pytest.mark.parametrize("claimed", [1 << 40, 1 << 70], ids=["1TiB", "2**70"])
def test_an_extended_header_claiming_more_than_one_may_hold_is_refused_unread(
        origin, tmp_path, kind, claimed):
    # tarfile reads such a header whole, in one read its claimed size asks for: the claim
    # alone, in 512 bytes, made it allocate that much (MemoryError) or fail (OverflowError)
    origin.files["/claims.tar"] = _extended_header(kind, claimed)
    with pytest.raises(FetchError, match=rf"an extended header of {claimed} bytes; at most "
                                         rf"{MAX_ARCHIVE_HEADER_BYTES}"):
        fetch_checkpoint(f"{origin.url}/claims.tar", tmp_path / "expert", FAST)
    _assert_nothing_left(tmp_path)


def test_an_archive_without_a_checkpoint_is_rejected(origin, tmp_path):
    origin.files["/empty.tar"] = _archive(lambda t: _add_bytes(t, "a/b/readme", b"hi"), "w")
    with pytest.raises(FetchError, match=r"the archive holds no checkpoint"):
        fetch_checkpoint(f"{origin.url}/empty.tar", tmp_path / "expert", FAST)
    _assert_nothing_left(tmp_path)


@pytest.mark.parametrize("uri, problem", [
    ("pvc://models/expert", "a pvc:// checkpoint is mounted, not fetched"),
    ("ftp://host/x", "is not a checkpoint URI"),
])
def test_uris_that_are_not_fetched_are_refused(tmp_path, uri, problem):
    with pytest.raises(FetchError, match=problem):
        fetch_checkpoint(uri, tmp_path / "expert", FAST)
    _assert_nothing_left(tmp_path)


def test_the_cli_reports_a_failure_in_one_line_with_exit_status_1(origin, tmp_path, capsys,
                                                                  termination_log):
    uri = f"{origin.url}/missing"
    # a failed fetch is a failure (1), not a usage error (2)
    assert main(["fetch-checkpoint", uri, str(tmp_path / "expert"), *ALLOW_LOOPBACK]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"ddm: error: {uri}: ")
    assert "HTTP 404" in captured.err and captured.err.count("\n") == 1
    # the pod's termination message, which the operator shows in the DDM's status
    assert termination_log.read_text() == captured.err.removeprefix("ddm: error: ")
    _assert_nothing_left(tmp_path)


# -- a small archive of large weights: checked in constant memory, capped on disk -------------

#: The zero weights the bomb inflates to, and what ``ddm fetch-checkpoint`` may use meanwhile:
#: the interpreter and its imports take about 40 MiB; loading the weights to check them (as
#: the fetcher once did) takes their size on top.
BOMB_WEIGHTS = 256 << 20
FETCH_RSS_BOUND = 128 << 20


def _zero_weights_bomb(smoke: Path) -> bytes:
    """A .tar.gz of a checkpoint whose weights are one ``BOMB_WEIGHTS``-byte tensor of zeros
    (a valid safetensors file, recorded in config.json): a few hundred kB on the wire."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [BOMB_WEIGHTS],
                               "data_offsets": [0, BOMB_WEIGHTS]}}).encode()
    prefix = struct.pack("<Q", len(header)) + header
    digest = hashlib.sha256(prefix)
    zeros = bytes(1 << 20)
    for _ in range(BOMB_WEIGHTS >> 20):
        digest.update(zeros)
    config = json.loads((smoke / CONFIG_FILE).read_text())
    config["weights_sha256"] = digest.hexdigest()

    def build(tar: tarfile.TarFile) -> None:
        _add_bytes(tar, CONFIG_FILE, json.dumps(config).encode())
        info = tarfile.TarInfo(WEIGHTS_FILE)
        info.size = len(prefix) + BOMB_WEIGHTS
        tar.addfile(info, _streamed(prefix, BOMB_WEIGHTS))

    return _archive(build)


def _streamed(prefix: bytes, zeros: int) -> io.BufferedReader:
    """``prefix`` then ``zeros`` zero bytes, streamed into an archive without ever being
    whole in memory."""

    class Stream(io.RawIOBase):
        def __init__(self) -> None:
            self.left = memoryview(prefix)
            self.zeros = zeros

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            if self.left:
                n = min(len(buffer), len(self.left))
                buffer[:n], self.left = self.left[:n], self.left[n:]
                return n
            n = min(len(buffer), self.zeros)
            buffer[:n] = bytes(n)
            self.zeros -= n
            return n

    return io.BufferedReader(Stream(), 1 << 20)


#: ``ddm fetch-checkpoint`` that writes its peak RSS (``VmHWM``, its own address space's: a
#: child's ``ru_maxrss`` starts at its parent's, from the fork) and the CPU seconds of the
#: command itself (imports excluded) to the file named first.
_MEASURED_CLI = """
import atexit, sys, time
from ddm.cli import main
report = sys.argv.pop(1)
started = time.process_time()
atexit.register(lambda: open(report, "w").write(next(
    line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    + f"cpu: {time.process_time() - started}\\n"))
sys.exit(main(sys.argv[1:]))
"""


@dataclass(frozen=True)
class Measured:
    """A child ``ddm fetch-checkpoint``: its exit status, peak RSS (bytes) and CPU seconds."""

    status: int
    peak: int
    cpu_s: float


def _fetch_in_a_child(url: str, dest: Path, *extra: str) -> Measured:
    """Run ``ddm fetch-checkpoint`` as its own process, measured."""
    report = dest.parent / "measured"
    status = subprocess.run([sys.executable, "-c", _MEASURED_CLI, str(report),
                             "fetch-checkpoint", url, str(dest), *ALLOW_LOOPBACK, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    peak, cpu = report.read_text().splitlines()
    report.unlink()
    return Measured(status, int(peak.split()[1]) << 10, float(cpu.split()[1]))


def test_an_archive_of_zero_weights_is_checked_without_loading_them(
        origin, smoke_expert_checkpoint, tmp_path):
    origin.files["/bomb.tar.gz"] = _zero_weights_bomb(smoke_expert_checkpoint)
    assert len(origin.files["/bomb.tar.gz"]) < BOMB_WEIGHTS // 256  # a small download
    run = _fetch_in_a_child(f"{origin.url}/bomb.tar.gz", tmp_path / "expert")
    assert run.status == 0
    assert (tmp_path / "expert" / WEIGHTS_FILE).stat().st_size > BOMB_WEIGHTS
    assert run.peak < FETCH_RSS_BOUND, f"peak RSS {run.peak >> 20} MiB"


def test_the_admins_lower_cap_refuses_the_bomb_and_leaves_nothing(
        origin, smoke_expert_checkpoint, tmp_path, termination_log):
    origin.files["/bomb.tar.gz"] = _zero_weights_bomb(smoke_expert_checkpoint)
    cap = 32 << 20
    run = _fetch_in_a_child(f"{origin.url}/bomb.tar.gz", tmp_path / "expert",
                            "--max-bytes", str(cap))
    assert run.status == 1
    assert ("archive member weights.safetensors: the archive inflates to more than the"
            in termination_log.read_text())
    _assert_nothing_left(tmp_path)


def test_a_small_archive_of_a_large_extended_header_is_refused_in_constant_memory(
        origin, tmp_path, termination_log):
    # a long name of BOMB_WEIGHTS zeros, a few hundred kB gzipped: tarfile reads it whole
    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = tarfile.GNUTYPE_LONGNAME, BOMB_WEIGHTS
    origin.files["/name.tar.gz"] = _archive(
        lambda tar: tar.addfile(info, _streamed(b"", BOMB_WEIGHTS)))
    assert len(origin.files["/name.tar.gz"]) < BOMB_WEIGHTS // 256  # a small download
    run = _fetch_in_a_child(f"{origin.url}/name.tar.gz", tmp_path / "expert")
    assert run.status == 1
    assert run.peak < FETCH_RSS_BOUND, f"peak RSS {run.peak >> 20} MiB"
    assert f"an extended header of {BOMB_WEIGHTS} bytes" in termination_log.read_text()
    _assert_nothing_left(tmp_path)


def _sparse_map_bomb(entries: int) -> bytes:
    """A .tar.gz of one GNU sparse file (format 1.0: pax records announce it, and its data
    starts with the map, ``entries`` (offset, size) pairs, one number a line): 47 kB for 12
    million entries, which tarfile reads into lists while it parses the header."""
    sparse_map = b"%d\n" % entries + b"0\n" * (2 * entries)
    info = tarfile.TarInfo("GNUSparseFile.0/weights.safetensors")
    info.size = len(sparse_map)
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                        "GNU.sparse.name": WEIGHTS_FILE, "GNU.sparse.realsize": "1024"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(sparse_map))
    return buffer.getvalue()


#: What refusing an archive may cost the fetcher: the interpreter and its imports take about
#: 40 MiB, and the refusal a few milliseconds of CPU. Parsing the 12-million-entry map took
#: 2.2 GiB and 22 s of CPU (docs/reliability.md).
REFUSAL_RSS_BOUND, REFUSAL_CPU_S = 100 << 20, 1.0


def test_a_sparse_map_bomb_is_refused_before_tarfile_reads_the_map(origin, tmp_path,
                                                                  termination_log):
    origin.files["/sparse.tar.gz"] = _sparse_map_bomb(12_000_000)
    assert len(origin.files["/sparse.tar.gz"]) < 64 << 10  # a small download
    run = _fetch_in_a_child(f"{origin.url}/sparse.tar.gz", tmp_path / "expert")
    assert run.status == 1
    assert termination_log.read_text().endswith(
        ": the archive has a GNU sparse file (pax record GNU.sparse.major); only regular "
        "files and directories are extracted\n")
    assert run.peak < REFUSAL_RSS_BOUND, f"peak RSS {run.peak >> 20} MiB"
    assert run.cpu_s < REFUSAL_CPU_S, f"{run.cpu_s:.1f} s of CPU"
    _assert_nothing_left(tmp_path)


def test_an_exported_directory_brings_the_program_its_config_names(origin,
                                                                   smoke_expert_checkpoint,
                                                                   tmp_path):
    """A directory URI of an exported expert: config.json names its program, which is fetched
    and checked against the SHA-256 config.json records (the stager's copies are such URIs)."""
    program = b"not really a torch.export archive"
    config = json.loads((smoke_expert_checkpoint / CONFIG_FILE).read_text())
    config["model"] = {"kind": "exported", "image_shape": [1, 8, 8]}
    config["program_sha256"] = hashlib.sha256(program).hexdigest()
    origin.files["/exported/config.json"] = json.dumps(config).encode()
    origin.files["/exported/weights.safetensors"] = (
        smoke_expert_checkpoint / WEIGHTS_FILE).read_bytes()
    origin.files["/exported/program.pt2"] = program
    dest = fetch_checkpoint(f"{origin.url}/exported", tmp_path / "expert", FAST)
    assert (dest / "program.pt2").read_bytes() == program
    origin.files["/exported/program.pt2"] = b"tampered"
    with pytest.raises(FetchError, match="program.pt2 is corrupt"):
        fetch_checkpoint(f"{origin.url}/exported", tmp_path / "again", FAST)
