"""Ports for brokers that tests stop and start again lie below this machine's ephemeral port range: inside it,
a stopped broker's port can be taken meanwhile by an outgoing connection (a reconnecting client even connects
to itself), and the broker then cannot start again (the chaos suite's 120 s outage once failed so)."""

from __future__ import annotations

from pathlib import Path

from rollout_bus.local_kafka.local_broker import port_is_free
from rollout_bus.local_kafka.local_cluster import free_ports

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_free_ports_are_below_the_ephemeral_range_free_in_pairs_and_apart():
    first_ephemeral = int(EPHEMERAL.read_text().split()[0]) if EPHEMERAL.exists() else 32768
    ports = free_ports(3)
    assert len(ports) == 3 and all(p + 1 < first_ephemeral for p in ports), (ports, first_ephemeral)
    assert all(port_is_free(p) and port_is_free(p + 1) for p in ports)
    assert all(abs(a - b) >= 2 for i, a in enumerate(ports) for b in ports[i + 1:])
