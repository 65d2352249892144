"""Figures of a tester run: coverage of each rule, divergences by class with their shrunk cells.

>>> from difftest import grammar
>>> coverage([grammar.generate(1), grammar.generate(2)])["holder=name"] <= 2
True
"""

from __future__ import annotations

from collections import Counter

from difftest import grammar


def coverage(cases: list[grammar.Case]) -> dict[str, int]:
    """How many cases each ``rule=option`` appeared in (every option, absences included)."""
    counts: Counter[str] = Counter()
    for case in cases:
        counts.update(f"{rule}={option}" for rule, option in case.choices)
    return {
        f"{rule}={option}": counts[f"{rule}={option}"] for rule, options in grammar.RULES.items() for option in options
    }


def coverage_lines(counts: dict[str, int]) -> list[str]:
    """One line per rule: each option with its count."""
    lines = []
    for rule, options in grammar.RULES.items():
        lines.append(f"  {rule}: " + ", ".join(f"{option} {counts[f'{rule}={option}']}" for option in options))
    return lines
