"""Test certificates and node keys for a deployed federation (TLS + Flower SuperNode authentication).

:func:`make_credentials` writes, into one directory:

- ``ca.pem`` / ``ca.key``: a self-signed certificate authority (EC P-384);
- ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by the CA, valid for the given
  host names and IP addresses (SANs; TLS clients check them);
- ``<center>.key`` / ``<center>.pub``: one EC P-384 key pair per center in OpenSSH format, the format
  ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read.

These are for tests and demos: a production federation gets its server certificate from its own CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Credentials", "check_node_credentials", "load_credentials", "make_credentials", "make_node_key"]


@dataclass(frozen=True)
class Credentials:
    """Paths of the files :func:`make_credentials` wrote."""

    directory: Path
    ca: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[tuple[str, Path, Path], ...]  # (center, private key, public key)

    def node_key(self, center: str) -> tuple[Path, Path]:
        for name, priv, pub in self.node_keys:
            if name == center:
                return priv, pub
        raise KeyError(f"no node key for center {center!r}; made for {[n for n, _, _ in self.node_keys]}")


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def make_node_key(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``<name>.key`` (OpenSSH private) and ``<name>.pub`` (OpenSSH public), EC P-384."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    priv = _write(directory / f"{name}.key", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()), True)
    pub = _write(directory / f"{name}.pub", key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    return priv, pub


def make_credentials(directory: str | Path, centers: Iterable[str],
                     hosts: Iterable[str] = ("127.0.0.1", "localhost"), days: int = 30) -> Credentials:
    """Create a CA, a SuperLink certificate for ``hosts`` and a key pair per center in ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    pem = serialization.Encoding.PEM

    def key_bytes(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "polyparallel collab test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    srv_key = ec.generate_private_key(ec.SECP384R1())
    srv = (x509.CertificateBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, next(iter(hosts), "localhost"))]))
           .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
           .add_extension(x509.SubjectAlternativeName(sans), critical=False)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
           .sign(ca_key, hashes.SHA256()))
    _write(d / "ca.key", key_bytes(ca_key), True)
    nodes = tuple((c, *make_node_key(d, c)) for c in centers)
    return Credentials(d, _write(d / "ca.pem", ca.public_bytes(pem)), _write(d / "server.pem", srv.public_bytes(pem)),
                       _write(d / "server.key", key_bytes(srv_key), True), nodes)


def load_credentials(directory: str | Path, centers: Iterable[str]) -> Credentials:
    """The :class:`Credentials` in a directory written by :func:`make_credentials` (files checked).

    Paths are made absolute: the SuperLink runs in another working directory.
    """
    d = Path(directory).resolve()
    nodes = tuple((c, d / f"{c}.key", d / f"{c}.pub") for c in centers)
    need = [d / "ca.pem", d / "server.pem", d / "server.key", *(pub for _, _, pub in nodes)]
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        raise FileNotFoundError(f"credentials incomplete in {d}: missing {missing} "
                                "(create them with `polyparallel collab-certs`)")
    unreadable = [str(p) for p in need if not _readable(p)]
    if unreadable:
        raise PermissionError(f"credentials in {d}: cannot read {unreadable}")
    return Credentials(d, d / "ca.pem", d / "server.pem", d / "server.key", nodes)


def _readable(p: Path) -> bool:
    try:
        with p.open("rb"):
            return True
    except OSError:
        return False


def check_node_credentials(ca: Path, key: Path) -> None:
    """Raise ValueError (one line) unless ``ca`` is a readable PEM certificate and ``key`` a readable
    OpenSSH EC private key — what ``flower-supernode`` needs; checked before starting it, because the
    SuperNode itself would retry a failing TLS handshake instead of saying why."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    for path, what in ((ca, "CA certificate (--ca)"), (key, "node private key (--key)")):
        if not path.is_file():
            raise ValueError(f"{what} {path}: no such file")
        if not _readable(path):
            raise ValueError(f"{what} {path}: not readable")
    try:
        x509.load_pem_x509_certificates(ca.read_bytes())
    except ValueError:
        raise ValueError(f"CA certificate (--ca) {ca}: not a PEM certificate") from None
    try:
        priv = load_ssh_private_key(key.read_bytes(), None)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(f"node private key (--key) {key}: not an unencrypted OpenSSH private key ({e})") from None
    if not isinstance(priv, ec.EllipticCurvePrivateKey):
        raise ValueError(f"node private key (--key) {key}: Flower needs an EC key (e.g. P-384), "
                         f"got {type(priv).__name__}")
