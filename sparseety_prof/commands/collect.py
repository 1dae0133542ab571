"""`collect SRC... DEST`: recordings into one Hive-partitioned Parquet dataset (store/dataset.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparseety_prof.commands.exit_codes import COLLECT_REFUSED
from sparseety_prof.commands.help_text import command_epilog

EXAMPLES = """\
  sparseety-prof collect rec1 rec2 fleet/                  # into the dataset fleet/ (created)
  sparseety-prof collect /var/lib/sparseety/*/ fleet/      # every recording of a host
  duckdb -c "select count(*) from 'fleet/tokens/**/*.parquet'"
"""

DESCRIPTION = """\
Add recordings to the dataset DEST (created when missing): one Parquet file per recording and
table under DEST/<table>/host=H/date=D/engine=E/model=M/, so that every query engine reads
DEST/<table>/**/*.parquet as one table (Hive partitioning), plus DEST/manifest.json listing each
recording collected (id, source, partition values, rows per table, sha256 of each file).
A recording already in DEST is skipped. A recording that is damaged, unclosed or not a recording
is refused with the reason and the others are collected (exit 11). Files are owner-only (0600).
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser(
        "collect",
        help="add recordings to a Hive-partitioned Parquet dataset (Polars, DuckDB, Spark)",
        description=DESCRIPTION,
        epilog=command_epilog("collect", EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("sources", type=Path, nargs="+", metavar="SRC", help="recording directories")
    c.add_argument("dest", type=Path, metavar="DEST", help="the dataset folder")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return collect_into(args.sources, args.dest)


def collect_into(sources: list[Path], dest: Path) -> int:
    """Collect `sources` into `dest`, showing progress on a terminal and one line per recording;
    the exit status (0, or COLLECT_REFUSED when a recording was refused)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sparseety_prof.store.dataset import collect
    from sparseety_prof.store.output_dir import sudo_owner
    from sparseety_prof.terminal_text import line, markup, visible

    console = Console(stderr=True)
    bar = Progress(
        TextColumn("collecting {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = bar.add_task("", total=len(sources))

    def progress(i: int, n: int, table: str, src: Path) -> None:
        bar.update(task, completed=i, description=markup(f"{src.name} {table}".strip()[:60]))

    with bar:
        report = collect(sources, dest, owner=sudo_owner(), progress=progress)
        bar.update(task, completed=len(sources))
    for e in report.collected:
        rows = ", ".join(f"{n} {t}" for t, n in e["rows"].items() if n)
        where = "/".join(f"{k}={e[k]}" for k in ("host", "date", "engine", "model"))
        print(
            line(
                f"sparseety-prof: collected {visible(e['source'])} as {e['id']} ({visible(where)}: "
                f"{rows or 'no rows'})"
            ),
            file=sys.stderr,
        )
    for src, rid in report.already:
        print(
            line(f"sparseety-prof: {visible(src)} is already in {dest} (id {rid}): skipped"), file=sys.stderr
        )
    for src, why in report.refused:
        # a recording's name is spelled out as token text is: a newline in it forges no line
        print(line(f"sparseety-prof: refused {visible(src)}: {visible(why)}"), file=sys.stderr)
    print(
        line(
            f"sparseety-prof: {dest}: {len(report.collected)} collected, {len(report.already)} already "
            f"there, {len(report.refused)} refused"
        ),
        file=sys.stderr,
    )
    return COLLECT_REFUSED if report.refused else 0
