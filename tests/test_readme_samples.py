"""The README's quick start: its sample outputs are what the commands print now
(scripts/readme_samples.py --check, on a real engine), its commands are the samples' commands, and
the normalisation that makes the check ignore times, PIDs and counts ignores nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import readme_samples as rs  # noqa: E402

README = (ROOT / "README.md").read_text()


# ------------------------------------------------------------------ the normalisation
LOG = "sparseety-prof: attached to PID 51234 (xllamacpp 2026.10.11549, 24 probes, compiled in 13.7s)"


def test_numbers_units_and_hashes_are_ignored() -> None:
    other = "sparseety-prof: attached to PID 7 (xllamacpp 2026.11.12000, 25 probes, compiled in 9.1s)"
    assert rs.normalise(LOG) == rs.normalise(other)
    assert rs.normalise("lag 1291 ms, sha256 d96287988c90") == rs.normalise("lag 1.3 s, sha256 0abc1234ef")


def test_wrapping_and_table_widths_are_ignored() -> None:
    wrapped = "sparseety-prof: attached to PID 51234 (xllamacpp 2026.10.11549, 24 probes, compiled\nin 13.7s)"
    assert rs.normalise(LOG) == rs.normalise(wrapped)
    narrow = "┏━━━━┳━━━━┓\n┃ tokens ┃ 72 ┃\n┗━━━━┻━━━━┛"
    wide = "┏━━━━━━━━━┳━━━━━━━━━━┓\n┃ tokens   ┃ 1024     ┃\n┗━━━━━━━━━┻━━━━━━━━━━┛"
    assert rs.normalise(narrow) == rs.normalise(wide)


def _wrap(text: str, width: int) -> list[str]:
    """Rich's wrapping of a cell: words greedily, a word longer than `width` on lines of its own,
    folded into pieces `width` long."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        elif len(word) <= width:
            lines.append(word)
        else:
            lines += [word[i : i + width] for i in range(0, len(word), width)]
    return lines


def _table(rows: list[tuple[str, str, str]], width: int) -> str:
    """A three-column table as Rich draws it, its last column `width` wide; a row's next lines
    have empty first cells."""
    lines = []
    for name, state, detail in rows:
        for k, piece in enumerate(_wrap(detail, width)):
            first, second = (name, state) if k == 0 else ("", "")
            lines.append(f"│ {first:<14} │ {second:<2} │ {piece:<{width}} │")
    return "\n".join(lines)


def test_a_path_a_table_cell_folds_is_the_same_on_any_host() -> None:
    rows = [
        ("bcc", "ok", "bcc 0.26.0 from {}/lib/python3.11/site-packages/bcc"),
        ("kernel headers", "ok", "{}/modules/build"),  # cut inside 'build' here: 'ild' alone
        ("server forks", "ok", "launch_slots_with_parent_task"),
    ]
    here = _table([(n, s, d.format("/work/main/.venv")) for n, s, d in rows], 27)
    elsewhere = _table([(n, s, d.format("/ci/v")) for n, s, d in rows], 60)
    assert "│ ild " in here  # the tail of a folded path, on the row's next line
    assert rs.normalise(here) == rs.normalise(elsewhere)
    assert {"bcc", "from", "kernel", "launch_slots_with_parent_task"} <= rs.normalise(elsewhere)


def test_the_status_line_of_a_service_log_is_ignored() -> None:
    record = next(s for s in rs.SAMPLES if s.name == "record")
    plain = "sparseety-prof: attached to PID 4242\nsparseety-prof: 72 tokens, 72 steps; stopped: SIGINT"
    status = (
        "sparseety-prof: status: tokens 40, requests 1, losses 0 (kernel_drops 0, seq_gaps 0,\n"
        "logits_incomplete 0), cpu 3.1 s (12.0% of a core), rss 280 MiB, ring peak 3%"
    )
    with_status = plain.replace("\n", "\n" + status + "\n")
    assert rs.normalise(plain, record.volatile) == rs.normalise(with_status, record.volatile)


def test_a_changed_word_or_line_is_a_difference() -> None:
    assert rs.normalise(LOG) != rs.normalise(LOG.replace("probes", "uprobes"))
    assert rs.normalise(LOG) != rs.normalise(LOG + "\nsparseety-prof: graph-op probes detached")
    assert rs.normalise("losses: 0 dropped") != rs.normalise("losses: 0 dropped, 0 journal")


# ------------------------------------------------------------------ the README's blocks
def test_every_sample_has_its_block_with_its_command() -> None:
    for s in rs.SAMPLES:
        output = rs.readme_output(README, s)  # raises SystemExit when missing or malformed
        assert output.strip(), f"the {s.name} sample is empty: run scripts/readme_samples.py"


def test_the_quick_start_shows_every_sample_command_in_the_first_60_lines() -> None:
    head = "\n".join(README.splitlines()[:60])
    assert "## Quick start" in head
    for s in rs.SAMPLES:
        assert s.shown() in head, s.shown()


def test_the_readme_stays_a_product_page() -> None:
    # under 400 lines; no sudo in its commands (they are for a root shell); links that resolve
    assert len(README.splitlines()) < 400
    code = "\n".join(README.split("```")[1::2])
    assert "sudo " not in code
    for target in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / target).exists(), target


def test_writing_samples_then_reading_them_back_gives_the_outputs() -> None:
    outputs = {s.name: f"{s.name} said 1\nand 2" for s in rs.SAMPLES}
    text = rs.write_samples(README, outputs)
    assert [rs.readme_output(text, s) for s in rs.SAMPLES] == list(outputs.values())
    assert rs.differences(text, outputs) == []
    changed = {**outputs, "report": "report said 1\nand something else"}
    assert [d.split(":")[0] for d in rs.differences(text, changed)] == ["report"]
    # outside the blocks nothing changes
    assert text.split("<!-- sample:doctor -->")[0] == README.split("<!-- sample:doctor -->")[0]


# ------------------------------------------------------------------ the real run
@pytest.mark.root
@pytest.mark.engine
def test_the_readme_samples_are_what_the_commands_print() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_samples.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, (
        f"README.md's samples differ from what the commands print now "
        f"(rerun scripts/readme_samples.py):\n{r.stdout}{r.stderr[-3000:]}"
    )
    assert "samples match" in r.stderr
