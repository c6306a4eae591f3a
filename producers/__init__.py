"""The publishing library a real generator uses: turns onto rollout.turns, engine responses to turns,
the staleness gate, and saying so while records wait for the broker; and a generator's whole run wired from
plain values (``generator_run``; settings end in ``rollout_bus.cli``).

Consumes: nothing (an inference engine's output) and rollout.weights through the gate. Produces: rollout.turns (one turn sample per record).
"""
