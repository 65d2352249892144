"""What travels between nbtrain's processes: the records, their framing and pickling, and
the kernel's state that a run carries to its ranks (logging, torch's settings, tracebacks'
stacks, where objects sit inside a cell's globals).
"""
