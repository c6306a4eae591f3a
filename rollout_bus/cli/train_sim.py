"""``python -m rollout_bus.cli.train_sim``: ``rollout-bus train-sim`` as a module of its own.

The command is ``rollout_bus.cli.train.train_sim`` (one trainer command for the real policy and the
stand-in); this name stays because the demo harness runs every stage as ``python -m rollout_bus.cli.<stage>``.
"""

from __future__ import annotations

import typer

from rollout_bus.cli.train import train_sim

if __name__ == "__main__":
    typer.run(train_sim)
