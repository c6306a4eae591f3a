"""How a rollout travels: every topic, key, header and record shape, byte for byte (WIRE.md).

The codec and its safetensors framing, the rollout key as the bus spells it, header names and the
header records, the records of every topic, the dead-letter record and its kinds, the partitioner
and read positions. Pure: no Kafka client, no sockets.
"""
