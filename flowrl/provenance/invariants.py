"""Invariants checked on every step's fingerprint record: silent failures named.

| name | fires when |
| --- | --- |
| ``weights_unchanged`` | an update left its role's weights bit-identical |
| ``weights_not_as_planned`` | a node ran on weights other than those of the version it reports (a rollout on stale weights under a new version number) |
| ``weights_arrived_different`` | weights loaded on another pool differ from what the update left |
| ``non_finite`` | NaN or inf in a node's output (node, field, step, first row) |
| ``constant_on_errors`` | a node that reported errors returned one value for its whole batch |

Each is a warning (said, and kept in the step's record in ``fingerprints.jsonl``);
``trainer.invariants: fatal`` makes the first one stop the run, ``off`` checks nothing.
Weight digests are compared by lineage: a role ``from: actor`` holds the actor's
version ``v`` weights when it reports version ``v``.

Example::

    checks = Invariants(header, say=print, fatal=False)
    found = checks.check(record, result)
"""

from __future__ import annotations

from typing import Any, Callable

from flowrl.errors import RuntimeFailure

NAMES = ("weights_unchanged", "weights_not_as_planned", "weights_arrived_different", "non_finite",
         "constant_on_errors")


class Fired(str):
    """The message of an invariant that fired, carrying its ``name``, ``node`` and ``step``: said as
    text, and a live view that reads ``node`` marks that node (:mod:`visualizer.live`)."""

    def __new__(cls, text: str, name: str, node: str, step: int) -> "Fired":
        out = super().__new__(cls, text)
        out.name, out.node, out.step = name, node, step
        return out


class InvariantError(RuntimeFailure):
    """An invariant broke and ``trainer.invariants`` is ``fatal``."""


class Invariants:
    """The invariants' memory across steps (each lineage's weight digest per version) and the checks."""

    def __init__(self, header: dict[str, Any], say: Callable[[str], None], fatal: bool = False) -> None:
        self.header, self.say, self.fatal = header, say, fatal
        self.lineage: dict[str, str] = header.get("lineage", {})
        self.known: dict[str, dict[int, str]] = {}  # lineage → version → digest

    def _base(self, role: str) -> str:
        seen = role
        while self.lineage.get(seen, seen) != seen:
            seen = self.lineage[seen]
        return seen

    def check(self, record: dict[str, Any], result: Any = None) -> list[dict[str, Any]]:
        """The invariants ``record`` (one step) breaks, each said as it is found."""
        step, nodes = record["step"], record["nodes"]
        found: list[dict[str, Any]] = []

        def fire(name: str, node: str, message: str, **where: Any) -> None:
            found.append({"name": name, "step": step, "node": node, **where, "message": message})
            self.say(Fired(f"invariant {name}: step {step}, node {node!r}: {message}", name, node, step))

        updates = {n: v["weights"] for n, v in nodes.items() if "after" in v.get("weights", {})}
        for node, w in updates.items():
            base = self._base(w["role"])
            if w.get("used") is not None and w["version"] is not None:
                self.known.setdefault(base, {})[w["version"]] = w["used"]
                self.known[base][w["version"] + 1] = w["after"]
            if w["after"] == w.get("used"):
                fire("weights_unchanged", node, f"the update left the weights of role {w['role']!r} unchanged "
                     f"(a learning rate of 0, no gradient, or an update that never reached the model)")
        for s in record.get("syncs", []):
            expected = self.known.get(self._base(s["role"]), {}).get(s["version"])
            if expected is not None and expected != s["digest"]:
                fire("weights_arrived_different", f"sync:{s['role']}",
                     f"weights of version {s['version']} loaded into role {s['role']!r} on pool "
                     f"{s['pool']} differ from those the update left", pool=s["pool"])
        for node, v in nodes.items():
            w = v.get("weights")
            if not w or node in updates or w.get("used") is None or w["version"] is None:
                continue
            expected = self.known.get(self._base(w["role"]), {}).get(w["version"])
            if expected is not None and expected != w["used"]:
                fire("weights_not_as_planned", node, f"ran on weights of role {w['role']!r} that are not those "
                     f"of version {w['version']} it reports (stale or partly loaded weights)")
        for node, v in nodes.items():
            for field, fp in v["fields"].items():
                if fp.get("nan") or fp.get("inf"):
                    fire("non_finite", node, f"{fp['nan']} NaN and {fp['inf']} inf in {field!r}, first at row "
                         f"{fp.get('first_bad')}", field=field, row=fp.get("first_bad"))
        found += self._constant_on_errors(record, result, fire)
        return found

    @staticmethod
    def _constant_on_errors(record: dict[str, Any], result: Any, fire: Callable[..., None]) -> list:
        """A node whose reports count errors (a metric named ``*error*`` or ``*fail*`` above 0) and
        whose float output holds one value over every row of several."""
        errors: dict[str, float] = {}
        for info in getattr(result, "infos", []) or []:
            for k, x in info.metrics.items():
                if ("error" in k or "fail" in k) and isinstance(x, (int, float)) and x > 0:
                    errors[info.node] = errors.get(info.node, 0.0) + x
        for node, count in errors.items():
            for field, fp in record["nodes"].get(node, {"fields": {}})["fields"].items():
                if fp["shape"] and fp["shape"][0] > 1 and fp.get("min") is not None and fp["min"] == fp["max"]:
                    fire("constant_on_errors", node, f"reported {count:g} errors and returned {fp['min']:g} in "
                         f"{field!r} for every one of its {fp['shape'][0]} rows (errors scored as a value bias "
                         f"the baseline)", field=field)
        return []

    def raise_if_fatal(self, found: list[dict[str, Any]]) -> None:
        if self.fatal and found:
            first = found[0]
            raise InvariantError(f"invariant {first['name']} at step {first['step']}, node {first['node']!r}: "
                                 f"{first['message']} (trainer.invariants is fatal)")


__all__ = ["NAMES", "Fired", "InvariantError", "Invariants"]
