"""The real policy learning through the bus: the calculator task, the generation engine, the trainer, the report."""
