"""apt commands wait for apt's and dpkg's locks instead of failing on them (unattended-upgrades
on a fresh machine, or a second build, may hold one): the locks are real fcntl locks, held here
by another process as apt holds them."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddm_devcluster.apt import AptError, wait_for_apt_locks

#: A process that takes an fcntl write lock on its argument as apt does, says so, and keeps it
#: until its stdin closes.
_HOLDER = """
import fcntl, sys
fd = open(sys.argv[1], "r+")
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    lock = tmp_path / "lock-frontend"
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield lock, holder
    finally:
        holder.kill()
        holder.wait()


def test_free_or_missing_locks_are_not_waited_for(tmp_path: Path) -> None:
    free = tmp_path / "lock"
    free.write_text("")
    said: list[str] = []
    wait_for_apt_locks(said.append, locks=(free, tmp_path / "missing"), timeout_s=0)
    assert said == []


def test_a_lock_another_process_holds_is_waited_for_until_released(
        held_lock: tuple[Path, subprocess.Popen[str]], tmp_path: Path) -> None:
    lock, holder = held_lock
    said: list[str] = []
    waiting = threading.Event()

    def log(line: str) -> None:
        said.append(line)
        waiting.set()

    waiter = threading.Thread(target=wait_for_apt_locks, args=(log,),
                              kwargs={"locks": (tmp_path / "missing", lock), "timeout_s": 600,
                                      "poll_s": 0.05})
    waiter.start()
    assert waiting.wait(60), "the wait never said what it waits for"
    assert waiter.is_alive()
    assert said == [f"waiting for {lock}: another apt or dpkg holds it"]
    assert holder.stdin is not None
    holder.stdin.close()  # the holder exits: the kernel releases its lock
    waiter.join(60)
    assert not waiter.is_alive()
    assert len(said) == 1


def test_a_lock_held_past_the_timeout_is_named(
        held_lock: tuple[Path, subprocess.Popen[str]]) -> None:
    lock, _ = held_lock
    with pytest.raises(AptError, match=f"{lock} is still held by another apt or dpkg after 0 s"):
        wait_for_apt_locks(lambda line: None, locks=(lock,), timeout_s=0)
