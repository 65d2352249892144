"""The kernel's plan of a run, made before any process starts: the machine's devices, the
device plan, the strategy and its config, whether the run fits, the cell's step total.
"""
