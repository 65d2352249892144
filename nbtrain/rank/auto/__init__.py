"""Auto mode: ``nbtrain.prepare`` and what a cell's models, optimizers and loaders become on
the ranks (wrapped, averaged, sharded), with the launch options applied to them.
"""
