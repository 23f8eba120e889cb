"""Result tables and their markdown / JSON forms (one structure, so both files hold the same numbers)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Column:
    """A table column: row key, header text and a format spec for numbers (``".2f"``)."""

    key: str
    header: str
    fmt: str = ""


@dataclass
class Table:
    """One benchmark section: columns, rows (dicts of raw values) and notes."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # further numbers for the JSON file

    def as_dict(self) -> dict:
        return {
            "title": self.title,
            "columns": [{"key": c.key, "header": c.header} for c in self.columns],
            "rows": self.rows,
            "notes": self.notes,
            "meta": self.meta,
        }


def ratio_cells(row: dict, ref: dict, keys: tuple[str, ...]) -> dict[str, str | None]:
    """``row[k] / ref[k]`` as ``"0.123x"`` for each key, None where either figure is missing or zero."""
    return {k: f"{row[k] / ref[k]:.3f}x" if row.get(k) and ref.get(k) else None for k in keys}


def fmt_value(value: object, spec: str = "") -> str:
    """Cell text: ``-`` for missing, yes/no for booleans, ``spec`` for numbers."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float)) and spec:
        return format(value, spec)
    return str(value)


def table_markdown(table: Table) -> str:
    """The table as a markdown pipe table, notes below."""
    lines = [f"## {table.title}", ""]
    lines.append("| " + " | ".join(c.header for c in table.columns) + " |")
    lines.append("|" + "|".join("---" for _ in table.columns) + "|")
    for row in table.rows:
        lines.append("| " + " | ".join(fmt_value(row.get(c.key), c.fmt) for c in table.columns) + " |")
    if table.notes:
        lines.append("")
        lines.extend(f"* {note}" for note in table.notes)
    return "\n".join(lines) + "\n"


def header_markdown(header: dict, settings: dict) -> str:
    """Title, environment lines and the exact settings."""
    lines = ["# deqscore benchmark", ""]
    lines.extend(f"* **{key}**: {value}" for key, value in header.items())
    lines += ["", "Settings (`lab/deqlab/settings.py`; the family sections build their networks from the configs "
              "with the options given in their notes):", "", "```json", json.dumps(settings, indent=1), "```", ""]
    return "\n".join(lines)


def write_reports(out_dir: Path, header: dict, settings: dict, tables: list[Table]) -> dict:
    """Write ``bench.md`` and ``bench.json`` under ``out_dir``; return the JSON document."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"header": header, "settings": settings, "sections": {t.name: t.as_dict() for t in tables}}
    md = header_markdown(header, settings) + "\n".join(table_markdown(t) for t in tables)
    (out_dir / "bench.md").write_text(md)
    (out_dir / "bench.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc
