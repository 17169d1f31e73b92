"""``host:port`` endpoints, as ``router.yaml`` lists replicas and the router's client dials them.

Its own module, below both: the client (``ddm.serving.http``, serving's bottom layer) needs the
parsing without the ``router.yaml`` reader. Plain Python only.
"""

from __future__ import annotations

__all__ = ["split_endpoint"]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` -> ``(host, port)``. An IPv6 address is written in brackets, as in a URL
    (``[::1]:8000``, RFC 3986: the form a ``Host`` header needs too), and comes out without
    them; without brackets it is refused, since ``::1:8000`` is an IPv6 address of its own.
    ValueError naming the endpoint when it is not ``host:port``."""
    host, _, port = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{endpoint!r}: an IPv6 address needs brackets, as in [::1]:8000")
    if not host or not port.isdigit():
        raise ValueError(f"{endpoint!r} is not host:port")
    return host, int(port)
