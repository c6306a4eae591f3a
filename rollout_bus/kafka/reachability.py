"""Why a bootstrap address does not answer, in words a person can act on, found in a second or two.

Why: a Kafka client that cannot bootstrap only says it timed out (kafka-python retries for as long as it is
allowed), so a typo in ``--bootstrap-servers`` or a broker that is not up looked like a long outage. A plain
TCP connect tells the cases apart at once: a refused port (nothing listens there), a host name that does not
resolve, a connect that never completes (packets dropped: a firewall, a partition), and a port that accepts
connections (then the trouble is past TCP: TLS or SASL settings, or not a Kafka listener).

Contract: ``diagnose(bootstrap_servers, timeout_s)`` returns one phrase per address, joined by ``; ``,
never raises, and takes at most ``timeout_s`` per address.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable


def _addresses(bootstrap_servers: str | Iterable[str]) -> list[str]:
    if isinstance(bootstrap_servers, str):
        bootstrap_servers = bootstrap_servers.split(",")
    return [a.strip() for a in bootstrap_servers if a and a.strip()]


def _split(address: str) -> tuple[str, int | None]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return address, None
    return host.strip("[]"), int(port)


def diagnose_one(address: str, timeout_s: float = 2.0) -> str:
    """What a TCP connect to ``host:port`` finds, as a phrase naming the address."""
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
    return (f"{address} accepts TCP connections but no Kafka answer came (a broker still starting, TLS or SASL "
            f"settings that do not match the listener, or not a Kafka port)")


def diagnose(bootstrap_servers: str | Iterable[str], timeout_s: float = 2.0) -> str:
    """``diagnose_one`` for every bootstrap address, joined by ``; ``."""
    found = [diagnose_one(a, timeout_s) for a in _addresses(bootstrap_servers)]
    return "; ".join(found) or "no bootstrap address given"
