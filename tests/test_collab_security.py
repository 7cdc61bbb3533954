"""Test credentials for deployed federations: a CA-signed server certificate and OpenSSH node keys."""

from __future__ import annotations

import ipaddress

import pytest

from polyparallel.backends.collab._security import load_credentials, make_credentials


def test_server_certificate_is_signed_by_the_ca_and_names_the_hosts(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    cr = make_credentials(tmp_path, ["a", "b"], hosts=["127.0.0.1", "server.example.org"])
    ca = x509.load_pem_x509_certificate(cr.ca.read_bytes())
    srv = x509.load_pem_x509_certificate(cr.server_cert.read_bytes())
    srv.verify_directly_issued_by(ca)  # raises if the signature or issuer does not match
    sans = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert sans.get_values_for_type(x509.DNSName) == ["server.example.org"]
    for name in ("a", "b"):
        priv, pub = cr.node_key(name)
        key = load_ssh_private_key(priv.read_bytes(), None)  # what flower-supernode does
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        assert load_ssh_public_key(pub.read_bytes()).public_numbers() == key.public_key().public_numbers()
        assert priv.stat().st_mode & 0o077 == 0
    assert load_credentials(tmp_path, ["a", "b"]) == cr


def test_incomplete_credentials_name_the_missing_files(tmp_path):
    make_credentials(tmp_path, ["a"])
    with pytest.raises(FileNotFoundError, match=r"b\.pub"):
        load_credentials(tmp_path, ["a", "b"])
