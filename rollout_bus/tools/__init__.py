"""Tools that drive or re-run the pipeline from outside it: replay from offsets (a stage's own pure
logic over the log), record inspection, and the demo runner (each stage its own process, watched
and reconciled against what the generator sent).
"""
