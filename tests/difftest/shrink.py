"""The smallest cell that still shows a divergence, and the class it names.

Shrinking drops the case's rules one at a time (each back to its absence) and keeps a drop
when the distributed run still diverges from its reference with a difference of the same
kind. What remains names the divergence class: way, kind and the rules it needs
(``2:identity:holder=mod_trainer``). A later divergence whose case holds a known class's rules
and shows its kind in its way is counted in that class without shrinking again.

>>> known = Class("2", "identity", ("holder=mod_trainer",), "")
>>> case = grammar.Case(0, tuple((r, o[0]) for r, o in grammar.RULES.items())).with_choice("holder", "mod_trainer")
>>> known.explains("2", "identity", case)
True
"""

from __future__ import annotations

from dataclasses import dataclass

from difftest import grammar, runner

KIND_ORDER = ("identity", "lost-update", "error", "structure", "value", "rng")


@dataclass(frozen=True)
class Class:
    """A divergence class: its way, kind, the rules its shrunk cell needs, and that cell's text."""

    way: str
    kind: str
    rules: tuple[str, ...]
    cell: str

    @property
    def name(self) -> str:
        return f"{self.way}:{self.kind}:{'+'.join(self.rules) or 'plain'}"

    def explains(self, way: str, kind: str, case: grammar.Case) -> bool:
        return way == self.way and kind == self.kind and set(self.rules) <= set(case.present())


def main_kind(divergence: runner.Divergence) -> str:
    """The divergence's most telling kind (an identity difference before a value difference)."""
    kinds = divergence.kinds()
    return next(kind for kind in KIND_ORDER if kind in kinds)


def shrink(run: runner.Runner, case: grammar.Case, way: str, kind: str) -> grammar.Case:
    """The case with every rule dropped whose absence still shows ``kind`` in ``way``."""
    for option in case.present():
        rule = option.split("=")[0]
        smaller = case.with_choice(rule, grammar.RULES[rule][0])
        if smaller == case:
            continue
        if any(kind in found.kinds() for found in runner.check(run, smaller, (way,))):
            case = smaller
    return case


def classify(run: runner.Runner, divergence: runner.Divergence, known: list[Class]) -> Class:
    """The class of ``divergence`` by its main kind; a new one (shrunk) is added to ``known``.

    The other kinds it shows ride along (a cell that fails part-way also leaves other values).
    """
    kind = main_kind(divergence)
    match = next((c for c in known if c.explains(divergence.way, kind, divergence.case)), None)
    if match is None:
        small = shrink(run, divergence.case, divergence.way, kind)
        match = Class(
            divergence.way, kind, tuple(small.present()), grammar.text(small, runner.WAYS[divergence.way].magic)
        )
        known.append(match)
    return match
