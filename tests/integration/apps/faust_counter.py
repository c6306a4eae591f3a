"""A minimal Faust app for the suite: counts records per key in a table and echoes each count.

Run as ``python -m tests.integration.apps.faust_counter BOOTSTRAP SOURCE SINK APP_ID DATADIR``.
"""

from __future__ import annotations

import sys

import faust


def build(bootstrap: str, source: str, sink: str, app_id: str, datadir: str) -> faust.App:
    app = faust.App(app_id, broker=f"kafka://{bootstrap}", store="memory://", topic_partitions=1, datadir=datadir,
                    topic_replication_factor=1, web_enabled=False, web_bind="127.0.0.1",
                    broker_session_timeout=10.0, broker_heartbeat_interval=3.0)  # as the stream app: a lost member goes in 10 s
    src = app.topic(source, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    out = app.topic(sink, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    counts = app.Table("counts", default=int, partitions=1, key_type=str, value_type=int)

    @app.agent(src)
    async def count(stream):
        async for event in stream.events():
            name = event.key.decode()
            counts[name] += 1
            app.log.info("counted %s at offset %d: %d", name, event.message.offset, counts[name])
            await out.send(key=event.key, value=str(counts[name]).encode())

    return app


if __name__ == "__main__":
    bootstrap, source, sink, app_id, datadir = sys.argv[1:6]
    sys.argv = [sys.argv[0], "worker", "--loglevel", "info", "--without-web"]
    build(bootstrap, source, sink, app_id, datadir).main()
