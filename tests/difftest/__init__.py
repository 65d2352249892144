"""A differential tester of ``%%distributed``: generated training cells run in the kernel and on ranks, compared.

grammar: the cells (seeded rules of what notebooks do) · snapshot: the kernel's state as a canonical
description (runs inside the kernel) · compare: two descriptions' differences · runner: real kernels,
the three ways a case runs · shrink: the smallest cell that still shows a divergence.
"""
