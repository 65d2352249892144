"""Two snapshot descriptions' differences, each with its kind and the path that leads to it.

Kinds: ``identity`` (a path leads to another object, or to a copy where one object was shared),
``lost-update`` (a tensor still holds its value from before the cell where the reference changed it),
``value`` (tensors beyond the tolerance, or Python values unequal), ``structure`` (type, shape,
dtype, requires_grad, a gradient present in one only, a name or item missing), ``rng``, ``error``.

>>> shared = {"id": 0, "type": "list", "items": [1]}
>>> ref = {"names": {"a": shared, "b": {"ref": 0}}, "rng": {}, "files": {}}
>>> got = {"names": {"a": shared, "b": {"id": 1, "type": "list", "items": [1]}}, "rng": {}, "files": {}}
>>> [(d.kind, d.path) for d in compare(ref, got, Rules())]
[('identity', 'b')]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Difference:
    """One difference: its kind, the path from a user name, and what each side held."""

    kind: str
    path: str
    detail: str


@dataclass(frozen=True)
class Rules:
    """How to compare: float tolerance, names compared by type only, and whether RNG states count."""

    rtol: float = 0.0
    atol: float = 0.0
    rng: bool = True
    type_only: frozenset[str] = frozenset()  # names whose values are a rank's own (its batch, its loss)
    loose_floats: bool = False  # per-rank BatchNorm statistics: floats compared only for a lost update
    strict: frozenset[str] = frozenset()  # names compared in full even then (they do not depend on the model)
    # Names whose numbers a schedule sized before the cell decides (its total and phases, learning rates,
    # momenta): under several ranks each takes a share of the steps it was sized for. Compared by type.
    scheduled: frozenset[str] = frozenset()
    before: dict[str, Any] = field(default_factory=dict)  # the pre-cell description, path -> values


def compare(ref: dict[str, Any], got: dict[str, Any], rules: Rules) -> list[Difference]:
    """The differences of ``got`` from the reference ``ref``."""
    diffs: list[Difference] = []
    walker = _Pair(rules, diffs)
    walker.names(ref["names"], got["names"], "")
    walker.names(ref.get("files", {}), got.get("files", {}), "file:")
    if rules.rng and ref["rng"] != got["rng"]:
        changed = sorted(key for key in ref["rng"] if ref["rng"][key] != got["rng"].get(key))
        diffs.append(Difference("rng", "rng:" + ",".join(changed), "generator states differ after the cell"))
    if ref.get("error") != got.get("error"):
        diffs.append(Difference("error", "error", f"reference: {ref.get('error')} · got: {got.get('error')}"))
    return diffs


def flat_values(description: dict[str, Any]) -> dict[str, list[float]]:
    """Each tensor's values by its first path (for lost-update checks against the pre-cell state)."""
    out: dict[str, list[float]] = {}

    def visit(node: Any, path: str) -> None:
        if isinstance(node, dict) and "id" in node:
            if "values" in node:
                out.setdefault(path, node["values"])
            for key, child in _children(node):
                visit(child, f"{path}{key}")

    for name, node in description["names"].items():
        visit(node, name)
    return out


def _children(node: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for part in ("modules", "attrs"):
        out += [(f".{key}", value) for key, value in node.get(part, {}).items()]
    items = node.get("items")
    if isinstance(items, list):
        for index, item in enumerate(items):
            if isinstance(item, list) and len(item) == 2 and node["type"].endswith(("dict", "OrderedDict")):
                out.append((f"[{item[0]!r}]", item[1]))
            else:
                out.append((f"[{index}]", item))
    for index, group in enumerate(node.get("groups", [])):
        out += [(f".param_groups[{index}][{key!r}]", value) for key, value in group.items()]
    for index, (param, values) in enumerate(node.get("state", []) if isinstance(node.get("state"), list) else []):
        out.append((f".state#{index}.key", param))
        out += [(f".state#{index}[{key!r}]", value) for key, value in values.items()]
    if isinstance(node.get("state"), dict):
        out.append((".state_dict()", node["state"]))
    for key in ("dataset", "grad"):
        if key in node:
            out.append((f".{key}", node[key]))
    out += [(f".tensors[{index}]", value) for index, value in enumerate(node.get("tensors", []))]
    return out


class _Pair:
    def __init__(self, rules: Rules, diffs: list[Difference]) -> None:
        self.rules = rules
        self.diffs = diffs
        self.pairs: dict[int, int] = {}  # reference id -> got id

    def add(self, kind: str, path: str, detail: str) -> None:
        self.diffs.append(Difference(kind, path, detail))

    def names(self, ref: dict[str, Any], got: dict[str, Any], prefix: str) -> None:
        for name in sorted(set(ref) | set(got)):
            if name not in got or name not in ref:
                where = "the reference only" if name in ref else "the distributed run only"
                self.add("structure", prefix + name, f"name set in {where}")
            elif name in self.rules.type_only:
                self.type_only(ref[name], got[name], prefix + name)
            else:
                self.node(ref[name], got[name], prefix + name)

    def type_only(self, ref: Any, got: Any, path: str) -> None:
        kinds = [node.get("type") if isinstance(node, dict) else type(node).__name__ for node in (ref, got)]
        if kinds[0] != kinds[1]:
            self.add("structure", path, f"type {kinds[0]} != {kinds[1]}")
        elif (
            isinstance(ref, dict)
            and isinstance(ref.get("items"), list)
            and len(ref["items"]) != len(got.get("items", []))
        ):
            self.add("value", path, f"{len(ref['items'])} items != {len(got.get('items', []))}")

    def node(self, ref: Any, got: Any, path: str) -> None:
        ref_obj, got_obj = (
            isinstance(ref, dict) and ("id" in ref or "ref" in ref),
            isinstance(got, dict) and ("id" in got or "ref" in got),
        )
        if not (ref_obj or got_obj):
            if ref != got and not self.scheduled(ref, got, path) and not self.near(ref, got, path):
                self.add("value", path, f"{ref!r} != {got!r}")
            return
        if ref_obj != got_obj:
            self.add("structure", path, f"{_short(ref)} != {_short(got)}")
            return
        if "ref" in ref or "ref" in got:
            self.reference(ref, got, path)
            return
        self.pairs[ref["id"]] = got["id"]
        if ref["type"] != got["type"]:
            self.add("structure", path, f"type {ref['type']} != {got['type']}")
            return
        if "values" in ref:
            self.tensor(ref, got, path)
        for key in ("name", "repr"):
            if key in ref and ref.get(key) != got.get(key) and key != "repr":
                self.add("value", path, f"{ref.get(key)!r} != {got.get(key)!r}")
        self.children(ref, got, path)

    def scheduled(self, ref: Any, got: Any, path: str) -> bool:
        """A number the schedule sized before the cell decides (its total, phases, rates): the same kinds of
        values. The steps it took (``last_epoch``, ``_step_count``) stay exact."""
        if _root(path) not in self.rules.scheduled or path.endswith((".last_epoch", "._step_count")):
            return False
        return _number_shape(ref) == _number_shape(got)

    def near(self, ref: Any, got: Any, path: str) -> bool:
        """Two Python floats (a validation loss's ``.item()``) as two tensor values would be: within the
        tolerance, or not compared where the rules leave the model's floats loose."""
        if not all(isinstance(value, float) for value in (ref, got)):
            return False
        return _close(ref, got, self.rules) or self.rules.loose_floats and _root(path) not in self.rules.strict

    def reference(self, ref: dict[str, Any], got: dict[str, Any], path: str) -> None:
        if "ref" in ref and "ref" in got:
            if self.pairs.get(ref["ref"]) != got["ref"]:
                self.add(
                    "identity",
                    path,
                    f"another object than the reference's (its object #{ref['ref']}, met first elsewhere)",
                )
        elif "ref" in ref:
            self.add("identity", path, f"a new object where the reference has the object met first as #{ref['ref']}")
        else:
            self.add("identity", path, f"the object met first as #{got['ref']} where the reference has its own")

    def children(self, ref: dict[str, Any], got: dict[str, Any], path: str) -> None:
        ref_children, got_children = dict(_children(ref)), dict(_children(got))
        for key in list(ref_children) + [key for key in got_children if key not in ref_children]:
            if key not in got_children or key not in ref_children:
                self.add(
                    "structure",
                    path + key,
                    "present in the reference only" if key in ref_children else "present in the run only",
                )
            else:
                self.node(ref_children[key], got_children[key], path + key)

    def tensor(self, ref: dict[str, Any], got: dict[str, Any], path: str) -> None:
        for key in ("dtype", "shape", "requires_grad"):
            if ref.get(key) != got.get(key):
                self.add("structure", path, f"{key} {ref.get(key)} != {got.get(key)}")
                return
        a, b = ref["values"], got["values"]
        worst = max((abs(x - y) for x, y in zip(a, b, strict=True) if not (_nan(x) and _nan(y))), default=0.0)
        if all(_close(x, y, self.rules) for x, y in zip(a, b, strict=True)):
            return
        before = self.rules.before.get(path)
        if before is not None and before == b and before != a:
            self.add(
                "lost-update",
                path,
                f"still holds its value from before the cell (the reference moved it by up to {_moved(a, before):.3g})",
            )
        elif not (
            self.rules.loose_floats and ref["dtype"].startswith("torch.float") and _root(path) not in self.rules.strict
        ):
            self.add("value", path, f"max |difference| {worst:.3g} over {len(a)} values")


def _number_shape(value: Any) -> Any:
    """``value`` with each int and float replaced by its type (in lists and tuples too)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_number_shape(item) for item in value)
    return value


def _root(path: str) -> str:
    return path.split(".")[0].split("[")[0]


def _moved(a: list[float], before: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, before, strict=False)), default=0.0)


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _close(x: Any, y: Any, rules: Rules) -> bool:
    if x == y or (_nan(x) and _nan(y)):
        return True
    return isinstance(x, float) and isinstance(y, float) and abs(x - y) <= rules.atol + rules.rtol * abs(x)


def _short(node: Any) -> str:
    if isinstance(node, dict):
        return (
            f"<{node.get('type', 'object')}>"
            if "id" in node
            else f"<object #{node.get('ref')}>"
            if "ref" in node
            else repr(node)
        )
    return repr(node)
