"""The demo harness (``rollout-bus demo``, ``make demo``): each stage its own process on a fresh set of topics,
watched while it runs and reconciled at its end against what the generator sent.
"""
