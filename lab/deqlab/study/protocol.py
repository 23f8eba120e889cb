"""The study's protocol: a versioned file, committed before any run it governs (``benchmarks/protocol/v<N>.json``).

It fixes, per family, the primary metric and its direction, the non-inferiority margin, the budget, the seeds of
every variant, the evaluation sizes and the fit options (the sampler's included); and, for all families, the rule
(:mod:`.verdict`), the definition of a flattened curve and the trust figures' threshold. Every unit records the
protocol's version and the SHA-256 of its file. A change is a new version, with its deviations listed in the file. A
unit of an earlier version still counts under a later one when the earlier file is unedited and everything of it
that governs the unit (the rule, the definitions, the trust threshold, the family's entry and the seeds of the
unit's variant: :meth:`Protocol.governing`) reads the same in both: a version that adds a variant or changes
another family does not void finished units. The report refuses every other unit.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deqscore.families import ROOT

PROTOCOL_DIR = ROOT / "benchmarks" / "protocol"
NOT_GOVERNING = ("version", "fixed", "question", "deviations", "families")  # every other key governs every unit


class ProtocolError(ValueError):
    """A protocol file that cannot be used, or units that do not belong to it."""


@dataclass(frozen=True)
class Protocol:
    version: int
    sha256: str
    path: Path
    text: dict[str, Any]

    @property
    def stamp(self) -> dict[str, Any]:
        """What a unit records of the protocol it ran under."""
        return {"version": self.version, "sha256": self.sha256}

    def family(self, name: str) -> dict[str, Any]:
        try:
            return self.text["families"][name]
        except KeyError:
            raise ProtocolError(f"{self.path}: no entry for family {name!r}") from None

    def seeds(self, family: str, variant: str) -> list[int]:
        """The seeds of ``variant`` (seeds 0 .. n-1); none for a variant the protocol does not run."""
        return list(range(self.family(family)["seeds"].get(variant, 0)))

    def margin(self, family: str, shallow_mean: float | None = None) -> float | None:
        """The family's non-inferiority margin; a relative margin needs the shallow network's mean (None
        without it)."""
        entry = self.family(family)
        if "margin" in entry:
            return float(entry["margin"])
        return None if shallow_mean is None else entry["margin_relative_to_shallow"] * abs(shallow_mean)

    @property
    def validations(self) -> int:
        return int(self.text["validations"])

    def governing(self, family: str, variant: str) -> dict[str, Any]:
        """Everything of this protocol that governs a unit of ``variant`` of ``family``: the rule, the definitions,
        the trust threshold, and the family's entry with the seeds of that variant alone."""
        entry = dict(self.family(family))
        seeds = entry.pop("seeds", {})
        shared = {key: value for key, value in self.text.items() if key not in NOT_GOVERNING}
        return {**shared, "family": entry, "seeds": seeds.get(variant, 0)}

    def governs(self, unit: dict[str, Any]) -> bool:
        """Whether ``unit`` counts under this protocol: recorded under it, or under an earlier version whose file
        is unedited and governs the unit identically (:meth:`governing`)."""
        stamp = unit["settings"].get("protocol")
        if stamp == self.stamp:
            return True
        if not isinstance(stamp, dict) or not isinstance(stamp.get("version"), int) or \
                stamp["version"] >= self.version:
            return False
        try:
            earlier = load(self.path.parent / f"v{stamp['version']}.json")
        except ProtocolError:
            return False
        return earlier.sha256 == stamp.get("sha256") and \
            earlier.governing(unit["family"], unit["variant"]) == self.governing(unit["family"], unit["variant"])


    def design_of(self, unit: dict[str, Any]) -> Protocol | None:
        """The protocol whose design ``unit`` belongs to: this one where it governs the unit (:meth:`governs`), else
        the newest earlier version that governs it alike with the version it was recorded under (whose file must be
        unedited); None for a unit of an edited file, of a later version or of none."""
        if self.governs(unit):
            return self
        stamp = unit["settings"].get("protocol")
        if not isinstance(stamp, dict) or not isinstance(stamp.get("version"), int) or \
                not 0 < stamp["version"] < self.version:
            return None
        try:
            own = load(self.path.parent / f"v{stamp['version']}.json")
        except ProtocolError:
            return None
        if own.sha256 != stamp.get("sha256"):
            return None
        for version in range(self.version - 1, own.version, -1):
            try:
                later = load(self.path.parent / f"v{version}.json")
            except ProtocolError:
                continue
            if later.governs(unit):
                return later
        return own


def newest(directory: Path = PROTOCOL_DIR) -> Path:
    """The protocol file of the highest version in ``directory``."""
    files = [(int(m.group(1)), p) for p in directory.glob("v*.json") if (m := re.fullmatch(r"v(\d+)\.json", p.name))]
    if not files:
        raise ProtocolError(f"no protocol file (v<N>.json) in {directory}")
    return max(files)[1]


def load(path: Path | None = None) -> Protocol:
    """The protocol at ``path`` (default: :func:`newest`); its version must match its file name."""
    path = Path(path) if path is not None else newest()
    try:
        raw = path.read_bytes()
        text = json.loads(raw)
    except (OSError, json.JSONDecodeError) as err:
        raise ProtocolError(f"--protocol {path}: {err}") from None
    version = text.get("version")
    if not isinstance(version, int) or path.name != f"v{version}.json":
        raise ProtocolError(f"--protocol {path}: holds version {version!r}; a protocol is named v<version>.json")
    return Protocol(version, hashlib.sha256(raw).hexdigest(), path, text)


def check_units(protocol: Protocol, units: list[dict]) -> None:
    """Refuse units the protocol does not govern (:meth:`Protocol.governs`): recorded under another version that
    governs them differently, or under an edited file."""
    foreign = [u for u in units if not protocol.governs(u)]
    if foreign:
        first = foreign[0]
        stamp = first["settings"].get("protocol") or "no protocol"
        raise ProtocolError(
            f"{len(foreign)} unit(s) were not recorded under protocol v{protocol.version} ({protocol.sha256[:12]}) "
            f"nor under an earlier version that governs them alike, e.g. "
            f"{first['family']}/{first['group']}/{first['variant']}_s{first['seed']} ({stamp}); a comparison "
            f"never mixes rules: move them aside or report them under their own protocol")
