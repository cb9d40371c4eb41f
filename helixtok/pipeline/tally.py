"""Tally: what a build skipped or repaired, counted, with the first few places of each."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..format.errors import InputError

MAX_EXAMPLES = 5  # locations kept per skip reason, for the summary and the manifest


STRICT = "(--strict: fix it, or leave --strict out to skip and count such records)"


@dataclass
class Tally:
    """Counts of what was skipped or repaired, with the first few locations of each."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    strict: bool = False  # --strict: the first problem is an error, where it is found
    first: str | None = None  # the first problem met, in reading order: what --strict reports

    def add(self, reason: str, where: str, n: int = 1) -> None:
        if self.strict:
            raise InputError(f"{where}: {reason.replace('_', ' ')} {STRICT}")
        if self.first is None:
            self.first = f"{where}: {reason.replace('_', ' ')}"
        self.counts[reason] = self.counts.get(reason, 0) + n
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def count(self, reason: str, where: str) -> None:
        """A record left out on purpose (a --map skip): counted, never an error under --strict."""
        strict, self.strict = self.strict, False
        try:
            self.add(reason, where)
        finally:
            self.strict = strict

    def merge(self, other: "Tally") -> None:
        self.first = self.first or other.first
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            ex = self.examples.setdefault(reason, [])
            ex.extend(other.examples.get(reason, [])[: MAX_EXAMPLES - len(ex)])

    def to_json(self) -> dict:
        return {r: {"count": self.counts[r], "examples": self.examples.get(r, [])} for r in sorted(self.counts)}

    @classmethod
    def from_json(cls, d: dict) -> "Tally":
        t = cls()
        for r, v in d.items():
            t.counts[r] = v["count"]
            t.examples[r] = list(v["examples"])
        return t
