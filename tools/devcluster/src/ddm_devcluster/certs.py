"""The dev cluster's keys and certificates, made with the ``openssl`` command-line tool.

One throw-away CA signs the API server's serving certificate; a separate RSA key pair signs
and verifies service-account tokens. Nothing here is meant to protect anything: the cluster
listens on 127.0.0.1 only.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Names clients and pods use for the API server; `create_pki` adds its addresses.
API_SERVER_SANS = (
    "IP:127.0.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files under one directory."""

    ca_cert: Path
    ca_key: Path
    apiserver_cert: Path
    apiserver_key: Path
    service_account_key: Path  # private: signs tokens (API server, controller-manager)
    service_account_pub: Path  # public: verifies tokens (API server)


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


def create_pki(directory: Path, api_server_ips: tuple[str, ...] = ()) -> Pki:
    """Write a fresh CA, API-server certificate and service-account key pair into ``directory``.

    ``api_server_ips``: addresses besides 127.0.0.1 the certificate is valid for (where the API
    server listens, and the cluster IP of the ``kubernetes`` Service).

    Takes a few hundred milliseconds (three 2048-bit RSA keys).
    """
    if shutil.which("openssl") is None:
        raise RuntimeError("the `openssl` command is needed (Debian package openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        apiserver_cert=directory / "apiserver.crt",
        apiserver_key=directory / "apiserver.key",
        service_account_key=directory / "sa.key",
        service_account_pub=directory / "sa.pub",
    )
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        "-keyout", pki.ca_key.name, "-out", pki.ca_cert.name,
        "-subj", "/CN=ddm-dev-cluster-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes",
        "-keyout", pki.apiserver_key.name, "-out", "apiserver.csr",
        "-subj", "/CN=kube-apiserver",
        cwd=directory,
    )  # fmt: skip
    sans = ",".join((*API_SERVER_SANS, *(f"IP:{ip}" for ip in api_server_ips)))
    (directory / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
        f"subjectAltName={sans}\n"
    )
    _openssl(
        "x509", "-req", "-in", "apiserver.csr", "-days", "3650",
        "-CA", pki.ca_cert.name, "-CAkey", pki.ca_key.name, "-CAcreateserial",
        "-extfile", "apiserver.ext", "-out", pki.apiserver_cert.name,
        cwd=directory,
    )  # fmt: skip
    _openssl("genrsa", "-out", pki.service_account_key.name, "2048", cwd=directory)
    _openssl(
        "rsa", "-in", pki.service_account_key.name, "-pubout",
        "-out", pki.service_account_pub.name,
        cwd=directory,
    )  # fmt: skip
    for key in (pki.ca_key, pki.apiserver_key, pki.service_account_key):
        key.chmod(0o600)
    return pki
