"""The DDM's checkpoint stager: ``ddm serve-checkpoints`` hands out what was fetched, and a
serving pod's ``ddm fetch-checkpoint`` copies it by the stager's name alone (a real server on
loopback; ``localhost`` plays the stager Service's name)."""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ddm.checkpoints.fetch import FetchError, FetchPolicy, fetch_checkpoint
from ddm.checkpoints.format import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint
from ddm.checkpoints.serve import make_server
from ddm.checkpoints.uri import staged_path

#: A serving pod's copy: the stager's name is allowed, no network is.
COPY = FetchPolicy(timeout_s=5.0, attempts=2, backoff_s=0.01, allowed_hosts=("localhost",))


@pytest.fixture
def stager(tmp_path: Path, smoke_expert_checkpoint: Path) -> Iterator[str]:
    root = tmp_path / "stage"
    root.mkdir()
    shutil.copytree(smoke_expert_checkpoint, root / "expert-a")
    server = make_server(root, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_serving_pod_copies_its_checkpoint_from_the_stager_by_name(
        stager, smoke_expert_checkpoint, tmp_path):
    dest = fetch_checkpoint(stager + staged_path("expert-a"), tmp_path / "pod" / "expert", COPY)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (dest / name).read_bytes() == (smoke_expert_checkpoint / name).read_bytes()
    assert load_checkpoint(dest).meta.name == "smoke-torch"


def test_a_directory_pin_holds_for_the_copy_too(stager, smoke_expert_checkpoint, tmp_path):
    pin = hashlib.sha256((smoke_expert_checkpoint / CONFIG_FILE).read_bytes()).hexdigest()
    url = stager + staged_path("expert-a")
    assert fetch_checkpoint(url, tmp_path / "pinned", COPY, sha256=pin).is_dir()
    with pytest.raises(FetchError, match="does not match the pinned"):
        fetch_checkpoint(url, tmp_path / "tampered", COPY, sha256="0" * 64)


def test_the_stagers_name_is_needed_its_address_alone_is_refused(stager, tmp_path):
    by_address = stager.replace("localhost", "127.0.0.1") + staged_path("expert-a")
    with pytest.raises(FetchError, match="does not resolve to an allowed address"):
        fetch_checkpoint(by_address, tmp_path / "expert", COPY)


def test_the_stager_serves_staged_files_with_their_length(stager, smoke_expert_checkpoint):
    answer = httpx.get(stager + staged_path("expert-a") + "/" + WEIGHTS_FILE)
    assert answer.status_code == 200
    assert answer.headers["content-length"] == str(len(answer.content))
    assert answer.content == (smoke_expert_checkpoint / WEIGHTS_FILE).read_bytes()


@pytest.mark.parametrize("path", ["/expert-b/config.json", "/expert-a", "/expert-a/",
                                  "/expert-a/.hidden", "/expert-a/%2e%2e/x", "/expert-a/link",
                                  "/expert-a/sub", "/"])
def test_the_stager_serves_staged_checkpoints_and_nothing_else(stager, path, tmp_path):
    staged = tmp_path / "stage" / "expert-a"
    (staged / ".hidden").write_text("x")
    (staged / "link").symlink_to("/etc/passwd")
    (staged / "sub").mkdir()
    assert httpx.get(stager + path).status_code == 404


def test_the_stager_is_read_only(stager):
    for method in ("PUT", "POST", "DELETE"):
        assert httpx.request(method, stager + staged_path("expert-a") + "/" + CONFIG_FILE
                             ).status_code == 501
