"""Why a bootstrap address does not answer, in words a person can act on, found in a second or two.

Why: a Kafka client that cannot bootstrap only says it timed out (kafka-python retries for as long as it is
allowed), so a typo in ``--bootstrap-servers`` or a broker that is not up looked like a long outage. A plain
TCP connect tells the cases apart at once: a refused port (nothing listens there), a host name that does not
resolve, a connect that never completes (packets dropped: a firewall, a partition), and a port that accepts
connections. Past TCP, the client's own security settings (``connection``: kafka-python's keywords) tell
the next cases apart with a TLS handshake: a listener that does not speak TLS to a TLS client, a certificate
the client's CA does not trust (the verifier's reason named), a TLS listener to a client set for
PLAINTEXT, and a verified TLS session whose SASL login the broker never completes (Kafka closes the
connection on a wrong password, a wrong user or a mechanism it does not enable, and says nothing more).

Contract: ``diagnose(bootstrap_servers, timeout_s, connection)`` returns one phrase per address, joined by
``; ``, never raises, and takes at most twice ``timeout_s`` per address (the connect, then the handshake).
``unreachable(bootstrap_servers, timeout_s)`` is the connect alone: the same phrases when no address accepts
a TCP connection, None when one does; every command asks it first, so a closed port is said in a second.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterable, Mapping
from typing import Any

TLS_PROTOCOLS = ("SSL", "SASL_SSL")


def _addresses(bootstrap_servers: str | Iterable[str]) -> list[str]:
    if isinstance(bootstrap_servers, str):
        bootstrap_servers = bootstrap_servers.split(",")
    return [a.strip() for a in bootstrap_servers if a and a.strip()]


def _split(address: str) -> tuple[str, int | None]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return address, None
    return host.strip("[]"), int(port)


def _protocol(connection: Mapping[str, Any]) -> str:
    return str(connection.get("security_protocol") or "PLAINTEXT").upper()


def _tls_context(connection: Mapping[str, Any], verify: bool) -> ssl.SSLContext:
    """The client's TLS settings as kafka-python applies them (``verify`` False: a probe that only asks
    whether the listener speaks TLS at all)."""
    if not verify:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    context = ssl.create_default_context(cafile=connection.get("ssl_cafile"))
    context.check_hostname = bool(connection.get("ssl_check_hostname", True))
    if connection.get("ssl_certfile"):
        context.load_cert_chain(connection["ssl_certfile"], connection.get("ssl_keyfile"))
    return context


def _handshake(sock: socket.socket, host: str, context: ssl.SSLContext) -> str | None:
    """None when a TLS handshake on ``sock`` completes, else why not (``verify:`` first when the peer's
    certificate was refused, ``timeout`` when no answer came)."""
    try:
        with context.wrap_socket(sock, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as exc:
        return f"verify: {exc.verify_message or exc.reason}"
    except (TimeoutError, socket.timeout):
        return "timeout"
    except (ssl.SSLError, OSError) as exc:
        return str(getattr(exc, "reason", None) or exc.strerror or exc)


def _past_tcp(address: str, host: str, sock: socket.socket, connection: Mapping[str, Any]) -> str:
    """What the client's TLS and SASL settings meet at a port that accepts TCP connections."""
    protocol = _protocol(connection)
    general = (f"{address} accepts TCP connections but no Kafka answer came (a broker still starting, TLS or SASL "
               f"settings that do not match the listener, or not a Kafka port)")
    if protocol not in TLS_PROTOCOLS:
        if _handshake(sock, host, _tls_context(connection, verify=False)) is None:
            return (f"{address} speaks TLS and this client is set for {protocol}: set ROLLOUT_BUS_SECURITY_PROTOCOL"
                    f"=SASL_SSL (or SSL) and ROLLOUT_BUS_SSL_CAFILE to the CA that signed the broker's certificate")
        return general
    try:
        context = _tls_context(connection, verify=True)
    except (ssl.SSLError, OSError) as exc:
        return (f"{address}: the client's TLS settings cannot be loaded (ssl_cafile={connection.get('ssl_cafile')!r}"
                f"): {getattr(exc, 'strerror', None) or exc}")
    why = _handshake(sock, host, context)
    if why is not None and why.startswith("verify: "):
        return (f"{address} presents a certificate this client does not trust ({why[8:]}): check "
                f"ROLLOUT_BUS_SSL_CAFILE={connection.get('ssl_cafile')!r} is the CA that signed the broker's certificate")
    if why == "timeout":
        return general
    if why is not None:
        return (f"{address} does not speak TLS ({why}) and this client is set for {protocol}: check "
                f"ROLLOUT_BUS_SECURITY_PROTOCOL against the listener (PLAINTEXT or SASL_PLAINTEXT?)")
    if protocol == "SASL_SSL":
        return (f"{address} completes TLS (certificate verified), but no Kafka answer came after the SASL login as "
                f"{connection.get('sasl_plain_username')!r} ({connection.get('sasl_mechanism') or 'PLAIN'}): a wrong "
                f"password or user, or a mechanism the listener does not enable (the broker closes the connection "
                f"and says no more); check ROLLOUT_BUS_SASL_* (or a broker still starting)")
    return (f"{address} completes TLS (certificate verified) but no Kafka answer came (a listener that wants SASL: "
            f"ROLLOUT_BUS_SECURITY_PROTOCOL=SASL_SSL? or a broker still starting)")


def diagnose_one(address: str, timeout_s: float = 2.0, connection: Mapping[str, Any] | None = None) -> str:
    """What a TCP connect to ``host:port``, then the client's TLS settings, find, as a phrase naming the address."""
    return _diagnose(address, timeout_s, connection or {}, tcp_only=False) or ""


def _diagnose(address: str, timeout_s: float, connection: Mapping[str, Any], *, tcp_only: bool) -> str | None:
    """``diagnose_one``; with ``tcp_only``, None once the TCP connect succeeds."""
    host, port = _split(address)
    if port is None:
        return f"{address!r} is not host:port"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"{address}: the host name {host!r} does not resolve ({exc.strerror})"
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(where)
        except ConnectionRefusedError:
            return f"{address} refuses connections (nothing listens there: is the broker up, is the port right?)"
        except (TimeoutError, socket.timeout):
            return (f"{address} does not answer a TCP connect within {timeout_s:.0f}s (packets dropped: a firewall "
                    f"or a network partition?)")
        except OSError as exc:
            return f"{address}: {exc.strerror or exc}"
        return None if tcp_only else _past_tcp(address, host, sock, connection)


def unreachable(bootstrap_servers: str | Iterable[str], timeout_s: float = 2.0) -> str | None:
    """Why no bootstrap address accepts a TCP connection (every one refused, unresolved, dropped or not
    host:port), as ``diagnose`` says it; None when one does (then only a Kafka client can tell the rest).
    No Kafka client is built: a closed port is said at once, without the client's own ERROR lines."""
    found = [_diagnose(a, timeout_s, {}, tcp_only=True) for a in _addresses(bootstrap_servers)]
    if any(phrase is None for phrase in found):
        return None
    return "; ".join(found) or "no bootstrap address given"


def diagnose(bootstrap_servers: str | Iterable[str], timeout_s: float = 2.0,
             connection: Mapping[str, Any] | None = None) -> str:
    """``diagnose_one`` for every bootstrap address, joined by ``; ``."""
    found = [diagnose_one(a, timeout_s, connection) for a in _addresses(bootstrap_servers)]
    return "; ".join(found) or "no bootstrap address given"
