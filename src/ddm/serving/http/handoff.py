"""Bound sockets handed to a server by the process that started it.

``ddm up`` draws its servers' ports when it plans the run, long before some of them bind:
the router starts only once every expert has loaded (minutes for a large DDM). A port free when
drawn could meanwhile be taken by anything else on the machine, and the server then failed
with "Address already in use". So the supervisor keeps each drawn port bound (not listening)
from the moment it draws it, and hands the bound socket to the server's process
(``subprocess.Popen(pass_fds=...)``), naming the descriptors in :data:`ENV` as systemd's socket
activation names its own in ``LISTEN_FDS``; the server listens on the one bound to its port
instead of binding the port again (:func:`handed_socket`).
"""

from __future__ import annotations

import os
import socket
from typing import Iterable, Mapping

__all__ = ["ENV", "HandoffError", "handed_socket", "handoff_env"]

#: The descriptors of the bound sockets a server was handed, comma-separated.
ENV = "DDM_LISTEN_FDS"


class HandoffError(RuntimeError):
    """:data:`ENV` names something that is not a bound socket this process holds."""


def handoff_env(sockets: Iterable[socket.socket]) -> tuple[str, str]:
    """The variable that tells a server started with ``pass_fds`` of ``sockets`` about them."""
    return ENV, ",".join(str(sock.fileno()) for sock in sockets)


def handed_socket(host: str, port: int,
                  environ: Mapping[str, str] = os.environ) -> socket.socket | None:
    """The socket this process was handed bound to ``port`` (no longer inherited by its own
    children), or None when it was handed none; the others stay open for their own ports.
    One bound to ``port`` on an address other than ``host``'s is refused: serving it would
    listen where the server was not asked to."""
    value = environ.get(ENV, "").strip()
    for item in filter(None, (part.strip() for part in value.split(","))):
        if not (item.isascii() and item.isdigit()) or int(item) > _LARGEST_FD:
            raise HandoffError(f"{ENV}={value!r}: {item!r} is not a file descriptor number")
        fd = int(item)
        try:
            sock = socket.socket(fileno=fd)
        except OSError as error:
            raise HandoffError(f"{ENV}={value!r}: descriptor {fd} is not a socket this process "
                               f"holds ({error.strerror or error})") from None
        try:
            bound = sock.getsockname()
        except OSError as error:
            sock.detach()
            raise HandoffError(f"{ENV}={value!r}: descriptor {fd} has no address "
                               f"({error.strerror or error})") from None
        if sock.type != socket.SOCK_STREAM or not isinstance(bound, tuple) or \
                bound[1] != port:
            sock.detach()  # another port's (or not ours to judge): left open as it was
            continue
        if bound[0] not in _addresses(host):
            sock.detach()
            raise HandoffError(f"{ENV}={value!r}: descriptor {fd} is bound to {bound[0]} port "
                               f"{port}, not to {host}")
        sock.set_inheritable(False)
        return sock
    return None


#: The largest descriptor number a process can hold (a C int's).
_LARGEST_FD = 2**31 - 1


def _addresses(host: str) -> set[str]:
    """The addresses ``host`` names (itself, where it is one)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return {host}
