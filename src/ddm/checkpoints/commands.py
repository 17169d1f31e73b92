"""``ddm fetch-checkpoint`` and ``ddm serve-checkpoints``: the commands the operator's init
containers and its checkpoint stager run, next to the fetcher and the server they drive.

``ddm.cli`` adds them with :func:`add_checkpoint_commands`. Importing this module is cheap (no
framework, no NumPy, no HTTP client). A bad argument is a ``ValueError`` (``ddm.cli`` reports
it, exit status 2); a fetch's error is also written where Kubernetes shows it (the pod's
termination message).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ddm.checkpoints.uri import STAGER_PORT
from ddm.termination import write_termination_message

if TYPE_CHECKING:
    from ddm.checkpoints.fetch import Contents


def add_checkpoint_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``fetch-checkpoint`` and ``serve-checkpoints`` to the ``ddm`` command's
    subcommands."""
    p = commands.add_parser("fetch-checkpoint",
                            help="download and verify a checkpoint (the operator's init "
                                 "container runs this)")
    p.add_argument("uri", nargs="?",
                   help="http(s)://... (a checkpoint directory or a .tar.gz of it), "
                        "s3://BUCKET/KEY or gs://BUCKET/KEY (read anonymously, or signed with "
                        "the cloud's credential chain when the bucket refuses); default "
                        "$DDM_CHECKPOINT_URI (from a Secret: a pre-signed URL's signature stays "
                        "off the command line)")
    p.add_argument("dest", type=Path,
                   help="directory to create, or an empty one (a volume's mount point)")
    add_fetch_options(p)
    p.set_defaults(handler=_fetch_checkpoint)

    p = commands.add_parser("serve-checkpoints",
                            help="serve fetched checkpoints read-only to the DDM's pods (the "
                                 "operator's checkpoint stager runs this)")
    p.add_argument("root", type=Path, help="the directory holding one checkpoint per key")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=STAGER_PORT, help="port to listen on")
    p.set_defaults(handler=_serve_checkpoints)


def add_fetch_options(p: argparse.ArgumentParser) -> None:
    """The fetcher's options (pin, credentials, networks, caps) on a command that fetches
    (``fetch-checkpoint``, ``fetch-data``); :func:`fetch_from_args` reads them."""
    p.add_argument("--sha256", metavar="HEX",
                   help="pin the download: the SHA-256 of the archive, or of config.json for a "
                        "directory (default $DDM_CHECKPOINT_SHA256); needed for plain http")
    p.add_argument("--headers-file", type=Path, metavar="PATH",
                   help="HTTP headers sent to the store ('Name: value' lines, e.g. "
                        "'Authorization: Bearer ...'; a mounted Secret; default "
                        "$DDM_FETCH_HEADERS_FILE)")
    p.add_argument("--store-credentials-file", type=Path, metavar="PATH",
                   help="the bucket's own credentials, signing every read: an AWS shared "
                        "credentials file ([default] aws_access_key_id, aws_secret_access_key) "
                        "for s3://, a Google service-account key (JSON) for gs:// (a mounted "
                        "Secret; not with --headers-file)")
    p.add_argument("--allow-network", action="append", metavar="CIDR",
                   help="a non-public network the store is in (repeatable; e.g. 10.0.3.7/32 "
                        "for an on-prem store; default $DDM_FETCH_ALLOW_NETWORKS, "
                        "comma-separated); cloud metadata addresses stay refused")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name that may resolve to a non-public address (repeatable; the "
                        "DDM's checkpoint stager Service); cloud metadata addresses stay refused")
    p.add_argument("--max-bytes", type=int, metavar="BYTES",
                   help="cap on everything downloaded and extracted (default "
                        "$DDM_FETCH_MAX_BYTES, else 16 GiB)")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="time for the whole download, every file and retry included "
                        "(default: an hour)")


def _fetch_checkpoint(args: argparse.Namespace) -> int:
    return fetch_from_args(args, None)


def fetch_from_args(args: argparse.Namespace, contents: Contents | None) -> int:
    """Run a fetch of ``contents`` (None: a checkpoint) as :func:`add_fetch_options`'s
    options say, from ``args.uri`` to ``args.dest``."""
    from ddm.checkpoints.destinations import parse_networks
    from ddm.checkpoints.fetch import (FetchError, FetchPolicy, fetch_checkpoint,
                                       read_headers_file)
    from ddm.checkpoints.uri import (CHECKPOINT_SHA256_ENV, CHECKPOINT_URI_ENV,
                                     FETCH_ALLOW_NETWORKS_ENV, FETCH_HEADERS_FILE_ENV,
                                     FETCH_MAX_BYTES_ENV, redact_uri)

    try:
        uri = args.uri or os.environ.get(CHECKPOINT_URI_ENV)
        if not uri:
            raise ValueError(f"give the checkpoint URI as an argument or in ${CHECKPOINT_URI_ENV}")
        if args.deadline is not None and not args.deadline > 0:
            raise ValueError(f"--deadline must be a positive number of seconds, "
                             f"got {args.deadline:g}")
        networks = (args.allow_network if args.allow_network is not None
                    else os.environ.get(FETCH_ALLOW_NETWORKS_ENV, "").split(","))
        try:
            policy = FetchPolicy(allowed_networks=parse_networks(networks),
                                 allowed_hosts=tuple(args.allow_host))
        except ValueError as exc:
            raise ValueError(f"--allow-network: {exc}") from None
        max_bytes = (args.max_bytes if args.max_bytes is not None
                     else os.environ.get(FETCH_MAX_BYTES_ENV))
        if max_bytes is not None:
            if not str(max_bytes).isdigit() or int(max_bytes) <= 0:
                raise ValueError(f"--max-bytes must be a positive number of bytes, "
                                 f"got {max_bytes}")
            policy = dataclasses.replace(policy, max_bytes=int(max_bytes))
        if args.deadline is not None:
            policy = dataclasses.replace(policy, deadline_s=args.deadline)
        headers_file = args.headers_file or os.environ.get(FETCH_HEADERS_FILE_ENV)
        dest = fetch_checkpoint(uri, args.dest, policy,
                                sha256=args.sha256 or os.environ.get(CHECKPOINT_SHA256_ENV) or None,
                                headers=read_headers_file(headers_file) if headers_file else None,
                                credentials_file=args.store_credentials_file,
                                contents=contents)
    except (ValueError, FetchError) as exc:
        write_termination_message(str(exc))  # the pod's status shows it; redacted already
        raise
    print(f"fetched {redact_uri(uri)} into {dest}")
    return 0


def _serve_checkpoints(args: argparse.Namespace) -> int:
    from ddm.checkpoints.serve import serve_checkpoints

    serve_checkpoints(args.root, args.host, args.port)  # a missing root: FileNotFoundError
    return 0
