"""A certificate authority and a broker's keystore for the secured local broker, made with the JDK's keytool.

Why keytool: the broker needs Java anyway, and keytool, shipped beside ``java``, makes a CA, signs a broker
certificate with the names clients dial, and writes the PKCS12 keystore Kafka reads, so no new Python
dependency is needed. Passwords reach keytool through files (``-storepass:file``), never its command line.

Contract: ``make_authority(dir, name)`` writes ``{name}.p12`` (the CA's key, PKCS12) and ``{name}.pem`` (its
certificate, what a client trusts) once and returns them; ``make_keystore(dir, authority, cn, hosts)``
writes ``{cn}.p12`` holding a key and its certificate signed by the authority for ``hosts`` (IP addresses
and DNS names: a client checks the name it dialled against them), with the CA certificate as its chain.
Each store's password is in ``{store}.password`` beside it; every file is readable by its owner only.
A keytool failure raises ``BrokerError`` with keytool's own words.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout_bus.errors import BrokerError

VALID_DAYS = 3650


@dataclass(frozen=True)
class Authority:
    """A CA: its PKCS12 key store, the store's password file, and its certificate in PEM."""

    store: Path
    password_file: Path
    certificate: Path


@dataclass(frozen=True)
class Keystore:
    """A PKCS12 keystore (key, certificate, CA chain) and its password file."""

    store: Path
    password_file: Path

    def password(self) -> str:
        return self.password_file.read_text().strip()


def keytool_beside(java: str) -> str:
    """The keytool of the JDK/JRE that ``java`` belongs to (``java`` may be a symlink, as Debian's is)."""
    tool = Path(java).resolve().parent / "keytool"
    if not tool.exists():
        raise BrokerError(f"no keytool beside {java} (looked for {tool}); the secured broker makes its "
                          f"certificates with the JDK's keytool")
    return str(tool)


def write_private(path: Path, text: str | bytes) -> None:
    """Write ``path`` readable by its owner only (created so, never widened for a moment)."""
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _run(keytool: str, args: Sequence[str], what: str, stdin: bytes | None = None) -> bytes:
    done = subprocess.run([keytool, *args], input=stdin, capture_output=True, check=False)
    if done.returncode != 0:
        words = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
        raise BrokerError(f"keytool could not {what} (exit {done.returncode}): {' / '.join(words[-3:])}")
    return done.stdout


def _password_file(store: Path) -> Path:
    password_file = store.with_suffix(".password")
    if not password_file.exists():
        write_private(password_file, secrets.token_urlsafe(24))
    return password_file


def make_authority(directory: Path, name: str, keytool: str) -> Authority:
    """The CA ``name`` in ``directory``, made once (a second call returns the existing one)."""
    directory.mkdir(parents=True, exist_ok=True)
    store, pem = directory / f"{name}.p12", directory / f"{name}.pem"
    password_file = _password_file(store)
    if not store.exists():
        _run(keytool, ["-genkeypair", "-alias", "ca", "-keyalg", "RSA", "-keysize", "2048",
                       "-dname", f"CN={name}", "-ext", "bc:c", "-validity", str(VALID_DAYS),
                       "-storetype", "PKCS12", "-keystore", str(store), "-storepass:file", str(password_file)],
             f"make the certificate authority {name}")
        os.chmod(store, 0o600)
    if not pem.exists():
        cert = _run(keytool, ["-exportcert", "-rfc", "-alias", "ca", "-keystore", str(store),
                              "-storepass:file", str(password_file)], f"export the certificate of {name}")
        pem.write_bytes(cert)
    return Authority(store, password_file, pem)


def _san(hosts: Sequence[str]) -> str:
    """keytool's SubjectAlternativeName extension for ``hosts`` (``ip:`` for addresses, ``dns:`` else)."""
    names = []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
            names.append(f"ip:{host}")
        except ValueError:
            names.append(f"dns:{host}")
    return "SAN=" + ",".join(names)


def make_keystore(directory: Path, authority: Authority, cn: str, hosts: Sequence[str], keytool: str) -> Keystore:
    """A keystore for ``cn`` signed by ``authority`` for ``hosts``, made once."""
    directory.mkdir(parents=True, exist_ok=True)
    store = directory / f"{cn}.p12"
    password_file = _password_file(store)
    if store.exists():
        return Keystore(store, password_file)
    partial = directory / f"{cn}.p12.partial"
    partial.unlink(missing_ok=True)
    own = ["-keystore", str(partial), "-storepass:file", str(password_file)]
    ca = ["-keystore", str(authority.store), "-storepass:file", str(authority.password_file)]
    _run(keytool, ["-genkeypair", "-alias", "key", "-keyalg", "RSA", "-keysize", "2048", "-dname", f"CN={cn}",
                   "-validity", str(VALID_DAYS), "-storetype", "PKCS12", *own], f"make the key of {cn}")
    request = _run(keytool, ["-certreq", "-alias", "key", *own], f"make the signing request of {cn}")
    signed = _run(keytool, ["-gencert", "-alias", "ca", "-rfc", "-validity", str(VALID_DAYS), "-ext", _san(hosts),
                            "-ext", "ku:c=digitalSignature,keyEncipherment", "-ext", "eku=serverAuth,clientAuth",
                            *ca], f"sign the certificate of {cn}", stdin=request)
    _run(keytool, ["-importcert", "-noprompt", "-alias", "ca", "-file", str(authority.certificate), *own],
         f"add the CA to the keystore of {cn}")
    _run(keytool, ["-importcert", "-alias", "key", *own], f"add the signed certificate of {cn}", stdin=signed)
    os.chmod(partial, 0o600)
    partial.rename(store)
    return Keystore(store, password_file)
