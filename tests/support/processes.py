"""Which process listens on a loopback port: how the local-runtime tests find the process
``ddm up`` restarted, and how ``python -m benchmarks load`` records the servers it measured."""

from __future__ import annotations

import os
from pathlib import Path


def listening_pid(port: int) -> int | None:
    """The process listening on loopback TCP ``port`` (this user's processes only)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue  # gone, or not ours
    return None
