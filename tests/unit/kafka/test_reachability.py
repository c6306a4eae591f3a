"""Why a bootstrap address does not answer, told apart with real sockets on loopback."""

from __future__ import annotations

import socket

from rollout_bus.kafka.reachability import diagnose, diagnose_one


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: nothing listens there


def test_a_closed_port_is_named_as_refusing_connections():
    port = _free_port()
    assert diagnose_one(f"127.0.0.1:{port}").startswith(f"127.0.0.1:{port} refuses connections (nothing listens")


def test_a_port_that_accepts_but_speaks_no_kafka_is_told_apart_from_a_refused_one():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        found = diagnose_one(f"127.0.0.1:{port}")
    assert found.startswith(f"127.0.0.1:{port} accepts TCP connections but no Kafka answer came"), found
    assert "TLS or SASL" in found


def test_an_unresolvable_host_and_a_malformed_address_are_named_and_every_address_is_reported():
    port = _free_port()
    found = diagnose(f"no-such-host.invalid:9092, 127.0.0.1:{port},localhost")  # .invalid never resolves (RFC 6761)
    unresolved, refused, malformed = found.split("; ")
    assert unresolved.startswith("no-such-host.invalid:9092: the host name 'no-such-host.invalid' does not resolve")
    assert refused.startswith(f"127.0.0.1:{port} refuses connections")
    assert malformed == "'localhost' is not host:port"
    assert diagnose("") == "no bootstrap address given"
