"""The laboratory's one result format (:mod:`deqlab.report`): every committed summary document under
``benchmarks/results/`` is of it and reads back through the reader, its page is what the writer renders from it, and
the page's table cells hold the JSON's numbers, read off the page by a parser of this test's own and compared within
the precision the column prints."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deqlab.report import (
    Column,
    Result,
    ResultFormatError,
    Table,
    pipe_table,
    read_result,
    result_markdown,
    write_result,
)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# per-unit files keep their own format (deqlab.units.recorded, the study's units): not summaries
UNIT_FOLDERS = {"units", "depth_units", "study", "study_v1", "tuning", "reruns"}
PILOT = "ncsn_cpu_pilot"  # raw output of one-off pilot scripts kept beside them, no program of the laboratory


def summaries() -> list[Path]:
    """The laboratory's summary documents: not a unit file, not a pilot's output, not the output of the one-off
    script beside it (``x.json`` next to ``x.py``)."""
    found = []
    for path in sorted(RESULTS.rglob("*.json")):
        folders = path.relative_to(RESULTS).parts[:-1]
        if not set(folders) & UNIT_FOLDERS and folders[:1] != (PILOT,) and not path.with_suffix(".py").exists():
            found.append(path)
    return found


def test_the_summaries_are_found():
    names = {str(p.relative_to(RESULTS)) for p in summaries()}
    assert {"bench.json", "gpu/gpu.json", "kernels/kernels.json", "sync/sync.json", "depth/bench.json",
            "deq_vs_ffn/deq_vs_ffn.json"} <= names


def page_tables(page: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header cells, row cells)`` of every ``## title`` of a page, in order (no cells for a table
    without columns); cells split at the pipes a backslash does not escape, ``\\|`` read as ``|``."""
    found: list[tuple[str, list[str], list[list[str]]]] = []
    for line in page.splitlines():
        if line.startswith("## "):
            found.append((line[3:], [], []))
        elif found and line.startswith("| "):
            cells = [c.strip().replace(r"\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
            title, header, rows = found[-1]
            if not header:
                header.extend(cells)
            else:
                rows.append(cells)
    return found


def tolerance(fmt: str, value: float) -> float:
    """How far a number printed with ``fmt`` may lie from its value: half a unit of the last digit printed."""
    if fmt in ("", ",", "d"):
        return 0.0  # every digit (repr, or an integer, with thousands separators or without)
    if match := re.fullmatch(r",?\.(\d+)f", fmt):
        return 0.5 * 10.0 ** -int(match.group(1))
    if match := re.fullmatch(r"\.(\d+)([ge])|(g)", fmt):
        digits = 6 if match.group(3) else int(match.group(1)) + (match.group(2) == "e")
        return 0.5 * 10.0 ** (1 - digits) * abs(value)
    raise AssertionError(f"no tolerance known for format {fmt!r}")


def cell_holds(cell: str, value: object, fmt: str) -> bool:
    """Whether a page cell shows ``value`` (a missing value as ``-``, a boolean as yes/no, a number to ``fmt``'s
    precision, anything else as its text)."""
    if value is None:
        return cell == "-"
    if isinstance(value, bool):
        return cell == ("yes" if value else "no")
    if isinstance(value, (int, float)):
        shown = float(cell.replace(",", ""))
        if not math.isfinite(value):
            return shown == value or (math.isnan(value) and math.isnan(shown))
        return abs(shown - value) <= tolerance(fmt, value) * (1 + 1e-12) + 1e-300
    return cell == str(value)


def assert_page_holds_the_numbers(doc: dict, page: str) -> None:
    tables = page_tables(page)
    assert [t[0] for t in tables] == [s["title"] for s in doc["sections"].values()]
    for (title, header, cells), section in zip(tables, doc["sections"].values(), strict=True):
        columns = section["columns"]
        assert header == [c["header"] for c in columns], title
        assert len(cells) == (len(section["rows"]) if columns else 0), title
        for row, line in zip(section["rows"], cells, strict=False):
            assert len(line) == len(columns), (title, line)
            for column, cell in zip(columns, line, strict=True):
                assert cell_holds(cell, row.get(column["key"]), column["fmt"]), (title, column["key"], cell,
                                                                                  row.get(column["key"]))


@pytest.mark.parametrize("path", summaries(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_committed_summary_is_of_the_one_format_and_its_page_is_the_writers(path):
    doc = read_result(path)
    page = path.with_suffix(".md").read_text()
    assert page == result_markdown(doc)
    assert_page_holds_the_numbers(doc, page)
    assert all((path.parent / plot).is_file() for plot in doc["plots"])


def test_the_writer_writes_what_the_reader_reads_and_the_page_shows(tmp_path):
    rows = [{"name": "a", "x": 0.123456, "n": 12345, "big": 1.5e-7, "ok": True, "missing": None, "raw": 2.0 / 3},
            {"name": "b", "x": float("inf"), "n": 7, "big": 3.25e4, "ok": False, "missing": None, "raw": -1e-20}]
    table = Table("t", "A table", [Column("name", "name"), Column("x", "x", ".2f"), Column("n", "n", ","),
                                   Column("big", "big", ".3g"), Column("ok", "ok"), Column("missing", "missing"),
                                   Column("raw", "raw")], rows, notes=["a note"], meta={"k": [1, 2]})
    failed = Table("failed", "a stage: failed", [], notes=["RuntimeError: out of memory"])
    result = Result("A result", {"device": "cpu: test", "date": "2026-01-01 00:00 UTC", "threads": 1},
                    {"repeats": 3}, [table, failed], plots=["p.png"], notes=["A paragraph."])
    doc = write_result(tmp_path, "demo", result)
    assert read_result(tmp_path / "demo.json") == doc == json.loads(json.dumps(result.as_dict()))
    page = (tmp_path / "demo.md").read_text()
    assert page == result_markdown(doc)
    assert_page_holds_the_numbers(doc, page)
    assert "| a | 0.12 | 12,345 | 1.5e-07 | yes | - | 0.6666666666666666 |" in page
    assert "* **device**: cpu: test" in page and "![p.png](p.png)" in page and "A paragraph." in page


def test_a_pipe_table_is_its_header_a_separator_as_wide_and_one_line_per_row():
    lines = pipe_table(["a", "b c", ""], [["1", "", "x"], ["2", "y", "z"]])
    assert lines == ["| a | b c | |", "|---|---|---|", "| 1 | | x |", "| 2 | y | z |"]
    assert pipe_table(["a"], []) == ["| a |", "|---|"]
    assert pipe_table(["max ||W||"], [["a|b"]]) == [r"| max \|\|W\|\| |", "|---|", r"| a\|b |"]  # no extra cells
    with pytest.raises(ValueError, match=r"row 2 has 1 cells for 3 columns \(a, b, c\)"):
        pipe_table(["a", "b", "c"], [["1", "2", "3"], ["1"]])
    with pytest.raises(ValueError, match=r"row 1 has 4 cells for 3 columns"):
        pipe_table(["a", "b", "c"], [["1", "2", "3", "4"]])


def test_the_checks_of_this_file_see_a_wrong_cell():
    table = Table("t", "T", [Column("x", "x", ".2f")], [{"x": 0.5}])
    doc = json.loads(json.dumps(Result("R", {"device": "d", "date": "t"}, {}, [table]).as_dict()))
    page = "# R\n\n## T\n\n| x |\n|---|\n| {} |\n"
    assert_page_holds_the_numbers(doc, page.format("0.50"))
    with pytest.raises(AssertionError):
        assert_page_holds_the_numbers(doc, page.format("0.51"))


@pytest.mark.parametrize("change, named", [
    (lambda d: d.pop("format"), "format None"),
    (lambda d: d.update(format=0), "format 0"),
    (lambda d: d["header"].pop("date"), "header without"),
    (lambda d: d["sections"]["t"]["columns"][0].pop("fmt"), "columns"),
    (lambda d: d.update(environment={}), "keys"),
])
def test_the_reader_refuses_another_shape_naming_the_file(tmp_path, change, named):
    table = Table("t", "T", [Column("x", "x")], [{"x": 1}])
    doc = json.loads(json.dumps(Result("R", {"device": "d", "date": "t"}, {}, [table]).as_dict()))
    change(doc)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultFormatError, match=f"{re.escape(str(path))}: not a result document.*{named}"):
        read_result(path)


def test_sync_keeps_the_sections_it_does_not_measure_from_its_previous_result(tmp_path, monkeypatch, capsys):
    from deqlab import main, sync

    previous = read_result(RESULTS / "sync" / "sync.json")
    (tmp_path / "sync.json").write_text((RESULTS / "sync" / "sync.json").read_text())
    fresh = [{"solver": "picard", "comparison": "bf16 vs float32", "hidden": 8, "batch": 2, "cosine": 0.5,
              "rel_error": 0.25, "loss_rel_diff": 0.125}]
    monkeypatch.setattr(sync, "bf16_gradient_rows", lambda hidden: fresh)
    doc = main(["sync", "--sections", "bf16_gradient", "--out", str(tmp_path)])
    assert doc == read_result(tmp_path / "sync.json")
    assert doc["sections"]["bf16_gradient"]["rows"] == fresh
    for name in ("syncs", "sync_sites", "nice_run"):
        assert doc["sections"][name]["rows"] == previous["sections"][name]["rows"]
    assert doc["header"]["measured"] == "bf16_gradient"
    with pytest.raises(SystemExit) as exc:  # nothing to keep the other sections from: one line, nothing written
        main(["sync", "--sections", "bf16_gradient", "--out", str(tmp_path / "none")])
    assert exc.value.code == 2 and "nice_run, syncs" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("environment, named", [({"ARM": "ncsnv3"}, "ARM="), ({"SCORE": "average"}, "SCORE=")])
def test_the_digits_pilot_refuses_a_wrong_setting_in_one_line_with_the_usage_status(tmp_path, environment, named):
    script = RESULTS / PILOT / "digits.py"
    done = subprocess.run([sys.executable, str(script)], cwd=RESULTS.parents[1], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path), **environment}, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"digits.py: {named}"), done.stderr
    assert not list(tmp_path.iterdir())  # refused before writing anything
