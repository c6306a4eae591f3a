"""``muted_client_logs``: the Kafka clients say nothing during a probe whose failure the caller says itself."""

from __future__ import annotations

import logging

from rollout_bus.kafka.client_logs import muted_client_logs


def test_client_loggers_are_silent_inside_the_block_and_as_before_after_it(caplog):
    caplog.set_level(logging.DEBUG)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    with muted_client_logs():
        logging.getLogger("kafka.net.manager").error("Connection failed")
        logging.getLogger("aiokafka").error("Unable to connect")
        logging.getLogger("rollout_bus.kafka.admin").warning("ours")
    logging.getLogger("kafka.net.manager").error("after")
    assert [r.getMessage() for r in caplog.records] == ["ours", "after"]
    assert logging.getLogger("kafka").level == logging.WARNING
