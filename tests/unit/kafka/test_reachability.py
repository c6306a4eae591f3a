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


def test_unreachable_names_a_closed_port_at_once_and_is_none_where_a_port_accepts():
    from rollout_bus.kafka.reachability import unreachable

    closed = _free_port()
    assert unreachable(f"127.0.0.1:{closed}").startswith(f"127.0.0.1:{closed} refuses connections")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert unreachable(f"127.0.0.1:{closed},127.0.0.1:{port}") is None  # one address that accepts is enough


def test_a_closed_port_is_a_broker_error_at_once_without_the_clients_own_log_lines(caplog):
    import logging
    import time

    import pytest

    from rollout_bus.errors import BrokerError
    from rollout_bus.kafka.admin import require_cluster, wait_for_cluster

    port = _free_port()
    caplog.set_level(logging.DEBUG)
    began = time.monotonic()
    with pytest.raises(BrokerError, match=f"127.0.0.1:{port} refuses connections"):
        require_cluster({"bootstrap_servers": f"127.0.0.1:{port}"})
    with pytest.raises(BrokerError, match="refuses connections"):
        wait_for_cluster({"bootstrap_servers": f"127.0.0.1:{port}"}, 0.5)
    assert time.monotonic() - began < 5.0
    assert not [r for r in caplog.records if r.name.split(".")[0] in ("kafka", "aiokafka")]
    waits = [r for r in caplog.records if "waiting for broker" in r.getMessage()]
    assert len(waits) == 1 and "refuses connections" in waits[0].getMessage()  # said after the first probe
