"""The CLI reads like its neighbours: grouped options, tuning flags out of --help but accepted and
documented, short forms, an examples epilog on every command whose examples parse as written (in
a root shell: no sudo), and a usage error for every flag combination that cannot work."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT

from sparseety_prof.cli import build_parser, command_modules
from sparseety_prof.commands.attach_flags import METRICS_EXPERT_MODES, TUNING_FLAGS
from sparseety_prof.commands.attach_options import options_from
from sparseety_prof.commands.exit_codes import codes_of
from sparseety_prof.errors import UsageError

BASE = ["record", "-p", "7", "-o", "rec"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _help(command: str) -> str:
    return _subparsers(build_parser())[command].format_help()


def test_every_command_has_examples_and_its_exit_codes_and_no_sudo() -> None:
    commands = _subparsers(build_parser())
    assert len(commands) == len(command_modules())
    for name, sub in commands.items():
        text = sub.format_help()
        assert "\nexamples:\n" in text and "\nexit codes:\n" in text, name
        listed = {int(m) for m in re.findall(r"^\s+(\d+) ", text.split("\nexit codes:\n")[1], re.M)}
        assert listed == {c.code for c in codes_of(name)}, name
        assert "sudo" not in text, name


def _example_lines(text: str) -> list[str]:
    block = re.split(r"\nexamples[^\n]*:\n", text, maxsplit=1)[1].split("\n\n", 1)[0]
    return [ln.split("  #", 1)[0].split(" | ", 1)[0].strip() for ln in block.splitlines() if ln.strip()]


def test_every_example_parses_as_written() -> None:
    """Each example that runs sparseety-prof parses with its own parser: flags that exist, values
    of the right type, what a mutually exclusive group allows. `$(pgrep ...)` stands for a PID."""
    parser = build_parser()
    seen = 0
    helps = [parser.format_help(), *(sub.format_help() for sub in _subparsers(parser).values())]
    for text in helps:
        for line in _example_lines(text):
            if not line.startswith("sparseety-prof "):
                continue  # a follow-up command (duckdb, jq) or a comment line
            argv = shlex.split(re.sub(r'"\$\([^)]*\)"', "12345", line))[1:]
            if "--" in argv:  # `launch -- COMMAND`: argparse.REMAINDER takes the rest
                argv = argv[: argv.index("--") + 2]
            parser.parse_args(argv)  # SystemExit (a usage error) fails the test
            seen += 1
    assert seen >= 2 * len(command_modules()) + 4


def test_record_and_attach_group_their_options() -> None:
    for command in ("record", "attach"):
        text = _help(command)
        for group in (
            "target:",
            "what to capture:",
            "output:",
            "sampling and policy:",
            "fleet outputs:",
            "GPU (CUDA engines):",
        ):
            assert f"\n{group}\n" in text, (command, group)
        target = text.split("\ntarget:\n", 1)[1].split("\n\n", 1)[0]
        assert "-p PID, --pid PID" in target and "--follow NAME" in target
        output = text.split("\noutput:\n", 1)[1].split("\n\n", 1)[0]
        assert "-d SECONDS, --duration SECONDS" in output and "-o DIR, --output DIR" in output


def test_tuning_flags_are_hidden_from_help_but_accepted() -> None:
    parser = build_parser()
    for command in ("record", "attach"):
        text = _help(command)
        for flag in TUNING_FLAGS:
            assert flag not in text, (command, flag)
        o = options_from(
            parser.parse_args(
                [
                    command,
                    "-p",
                    "7",
                    "-o",
                    "rec",
                    "--drain-interval",
                    "2",
                    "--ring-mb",
                    "128",
                    "--max-drain-gap",
                    "8",
                    "--correlate-every",
                    "1",
                    "--bpf-stats",
                    "--moe-read",
                    "ops",
                    "--discover-layout",
                    "--discover-timeout",
                    "30",
                ]
            )
        )
        assert (o.drain_interval, o.ring_mb, o.max_drain_gap, o.correlate_every) == (2.0, 128, 8.0, 1.0)
        assert (o.bpf_stats, o.moe_read, o.discover_layout, o.discover_timeout) == (True, "ops", True, 30.0)


def _documented_defaults() -> dict[str, str]:
    doc = (ROOT / "docs" / "tuning.md").read_text()
    found = re.findall(r"^### `(--[a-z-]+)[^`]*`\n\nDefault: `([^`]*)`", doc, re.M)
    return dict(found)


def _shown(value: object) -> str:
    if isinstance(value, bool) or value == "":
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def test_every_tuning_flag_is_documented_with_the_default_the_code_uses() -> None:
    documented = _documented_defaults()
    assert set(documented) == set(TUNING_FLAGS)
    o = options_from(build_parser().parse_args(BASE))
    attr = {flag: flag.removeprefix("--").replace("-", "_") for flag in TUNING_FLAGS}
    for flag, default in documented.items():
        assert default == _shown(getattr(o, attr[flag])), flag


def test_short_forms() -> None:
    p = build_parser()
    o = options_from(p.parse_args(["record", "-p", "42", "-d", "3.5", "-o", "r"]))
    assert (o.pid, o.duration, o.out) == (42, 3.5, Path("r"))
    assert p.parse_args(["check", "-p", "9"]).pid == 9
    assert p.parse_args(["doctor", "-p", "9"]).pid == 9


def test_defaults_come_from_the_options() -> None:
    """A flag not given leaves the Options default (session/options.py), the one place it is set."""
    from sparseety_prof.session.options import Options

    o = options_from(build_parser().parse_args(BASE))
    ref = Options(pid=7, out=Path("rec"))
    for attr in (
        "flush_interval",
        "nice",
        "sched",
        "max_drain_gap",
        "drain_interval",
        "slice_us",
        "ring_mb",
        "correlate_every",
        "policy_window",
        "max_memory",
        "aggregate_s",
        "discover_timeout",
        "moe_read",
        "capture",
        "request_header",
    ):
        assert getattr(o, attr) == getattr(ref, attr), attr


def test_metrics_expert_modes_are_the_sinks() -> None:
    from sparseety_prof.session.metrics_sink import EXPERT_MODES

    assert set(METRICS_EXPERT_MODES) == set(EXPERT_MODES)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--metrics-bind", "0.0.0.0"], "need --metrics-port"),
        (["--metrics-experts", "aggregate"], "need --metrics-port"),
        (["--otlp-steps"], "need --otlp URL"),
        (["--otlp-token-events", "0.5"], "need --otlp URL"),
        (["--preset", "vllm"], "need --late-attach"),
        (["--policy-window", "8M"], "--policy-window bounds the rows"),
        (["--policy", "head:0.1", "--policy-window", "8M"], "--policy-window bounds the rows"),
        (["--mode", "tokens", "--act-threshold", "0.1"], "--act-threshold: --mode tokens"),
        (["--mode", "tokens", "--moe-read", "ops"], "--moe-read: --mode tokens"),
        (["--mode", "tokens", "--duty-cycle", "2s/20s"], "--duty-cycle: --mode tokens"),
        (["--duty-cycle", "20s/2s"], "--duty-cycle: the period must be longer"),
        (["--duty-cycle", "2s"], "--duty-cycle: expected ON/PERIOD"),
        (["--duty-logits"], "--duty-logits switches the logits probes with --duty-cycle's windows"),
        (["--recorder-cpus", "all"], "--recorder-cpus must be auto, none or a CPU list"),
        (["-d", "0"], "--duration must be a positive"),
        (["--nice", "40"], "--nice must be from -20 to 19"),
        (["--discover-timeout", "0"], "--discover-timeout must be a positive"),
    ],
)
def test_combinations_that_cannot_work_are_usage_errors(extra: list[str], message: str) -> None:
    p = build_parser()
    for command in ("record", "attach"):
        with pytest.raises(UsageError, match=re.escape(message)) as e:
            options_from(p.parse_args([command, "-p", "7", "-o", "rec", *extra]))
        assert e.value.exit_code == 2


def test_the_same_flags_work_together() -> None:
    """The counterparts of the refused combinations, given what they need, are accepted."""
    p = build_parser()
    for extra in (
        ["--policy", "tail:0.9", "--policy-window", "8M"],
        ["--capture-router-probs", "--redact", "routing", "--redact-layers", "0-3"],
        # a redaction of what is captured is a check that the redaction holds (the audit's runs)
        ["--capture-masks", "--redact", "sparsity,masks"],
        ["--mode", "tokens"],
        ["--moe-read", "ops"],
    ):
        options_from(p.parse_args([*BASE, *extra]))


def test_a_policy_without_a_recording_is_refused() -> None:
    p = build_parser()
    with pytest.raises(UsageError, match="--policy decides what the recording keeps"):
        options_from(p.parse_args(["attach", "-p", "7", "--policy", "head:0.1"]))
    assert options_from(p.parse_args(["attach", "-p", "7"])).policy == ("full",)


HELP_FIGURE = re.compile(r"\d[\d.,-]*\s*(?:us|µs|ms|%|MiB/s|MB/s|MB|tokens/s)\b")


def test_help_texts_carry_no_measured_figures() -> None:
    """Measurements go stale: they live in docs/ with their command and date, not in --help."""
    for name, sub in _subparsers(build_parser()).items():
        text = sub.format_help().split("\nexamples:\n", 1)[0]
        figures = [
            m.group() for m in HELP_FIGURE.finditer(text) if not text[: m.start()].endswith("default ")
        ]
        assert not figures, (name, figures)
