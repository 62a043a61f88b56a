"""TLS material for a SuperLink: a CA and the SuperLink's certificate, made with ``cryptography``.

``secure-afl deploy tls`` (a coordinator host, names and addresses given) and ``secure-afl deploy
local`` (a throwaway pair for 127.0.0.1/localhost) both call :func:`write_tls_material`.  Files:

==================  =====  =========================================================================
file                mode   used by
==================  =====  =========================================================================
``ca.crt``          0644   ``flower-superlink --ssl-ca-certfile``; every SuperNode's
                           ``--root-certificates`` (and ``root-certificates`` in ``$FLWR_HOME``)
``ca.key``          0600   nobody at run time: keep it offline; it signs a new SuperLink certificate
``superlink.pem``   0644   ``flower-superlink --ssl-certfile``
``superlink.key``   0600   ``flower-superlink --ssl-keyfile``
==================  =====  =========================================================================

Keys are ECDSA P-384, signatures SHA-256.  The SuperLink's certificate lists every host name and IP
address given as a subjectAltName: a SuperNode connecting by a name or address not in that list
fails the TLS handshake, so the list must cover what hospitals put in ``--superlink``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "MAX_DAYS",
    "SUPERLINK_CERT_FILE",
    "SUPERLINK_KEY_FILE",
    "TlsError",
    "TlsFiles",
    "TlsFilesExistError",
    "parse_host_name",
    "parse_ip_address",
    "write_tls_material",
]

CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
SUPERLINK_CERT_FILE = "superlink.pem"
SUPERLINK_KEY_FILE = "superlink.key"
MAX_DAYS = 3650  # ten years; a longer-lived CA outlives the keys it vouches for
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class TlsError(ValueError):
    """Bad input for the TLS material (a name, an address, a validity) or files already there."""


class TlsFilesExistError(TlsError, FileExistsError):
    """The directory already holds TLS files and ``force`` was not given."""


@dataclass(frozen=True)
class TlsFiles:
    """The paths written by :func:`write_tls_material`; ``ca_key`` is None when it was not kept."""

    ca_certificate: Path
    ca_key: Path | None
    certificate: Path
    key: Path


def parse_host_name(name: str) -> str:
    """A DNS host name (``coordinator.hospital.org``, ``localhost``), lower-cased; else :class:`TlsError`."""
    text = name.strip().rstrip(".").lower()
    try:
        ipaddress.ip_address(text)
    except ValueError:
        pass
    else:
        raise TlsError(f"{name!r} is an IP address: give it with --ip, not --host")
    labels = text.split(".")
    if not text or len(text) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise TlsError(
            f"{name!r} is not a host name: use letters, digits and '-' in dot-separated labels of at most "
            "63 characters (e.g. coordinator.hospital.org); give IP addresses with --ip"
        )
    return text


def parse_ip_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4 or IPv6 address (``10.0.0.5``, ``fd00::5``); else :class:`TlsError`."""
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        raise TlsError(
            f"{text!r} is not an IP address: give an IPv4 (10.0.0.5) or IPv6 (fd00::5) address with --ip, "
            "and host names with --host"
        ) from None


def write_tls_material(
    directory: Path,
    *,
    hosts: Sequence[str] = (),
    ips: Sequence[str] = (),
    days: int = 365,
    keep_ca_key: bool = True,
    force: bool = False,
    ca_common_name: str = "secure-afl SuperLink CA",
) -> TlsFiles:
    """A new CA and a SuperLink certificate for ``hosts`` and ``ips`` under ``directory``.

    Refuses (:class:`TlsError`) an invalid name or address, no name and no address, ``days`` outside
    1..:data:`MAX_DAYS`, and files already present unless ``force``.  Keys are written mode 0600
    (a temporary file renamed into place), certificates 0644.  ``keep_ca_key=False`` discards the
    CA's key once it has signed (a throwaway CA, as ``deploy local`` uses).
    """
    names = list(dict.fromkeys(parse_host_name(h) for h in hosts))
    addresses = list(dict.fromkeys(parse_ip_address(a) for a in ips))
    if not names and not addresses:
        raise TlsError(
            "give at least one --host NAME or --ip ADDR: the name or address SuperNodes connect to"
        )
    if not 1 <= days <= MAX_DAYS:
        raise TlsError(f"validity of {days} days: use 1..{MAX_DAYS} (--days)")
    directory = Path(directory)
    files = TlsFiles(
        ca_certificate=directory / CA_CERT_FILE,
        ca_key=directory / CA_KEY_FILE if keep_ca_key else None,
        certificate=directory / SUPERLINK_CERT_FILE,
        key=directory / SUPERLINK_KEY_FILE,
    )
    targets = [p for p in (files.ca_certificate, files.ca_key, files.certificate, files.key) if p is not None]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise TlsFilesExistError(
            f"{', '.join(existing)} already exist(s): choose another directory or pass --force"
        )
    directory.mkdir(parents=True, exist_ok=True)

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_common_name)])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    common_name = names[0] if names else str(addresses[0])
    alternative_names: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    alternative_names += [x509.IPAddress(a) for a in addresses]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(key_cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    if files.ca_key is not None:
        write_with_mode(files.ca_key, _private_pem(ca_key), 0o600)
    write_with_mode(files.key, _private_pem(key), 0o600)
    write_with_mode(files.ca_certificate, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    write_with_mode(files.certificate, certificate.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


def _key_usage(*, key_cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=key_cert_sign,
        crl_sign=key_cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_with_mode(path: Path, data: bytes, mode: int) -> None:
    """A temporary file created with ``mode`` (never wider, whatever the umask), renamed into place."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.chmod(temporary, mode)  # the umask may have narrowed it; keys never end wider than asked
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
