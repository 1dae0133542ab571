"""One source of truth for the defaults of `record` and `attach`: the parser writes none (a flag
not given parses to None), so the Options made from a command line that gives none of them are the
Options' own defaults (session/options.py), field by field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sparseety_prof.capture.options import Capture
from sparseety_prof.cli import build_parser
from sparseety_prof.commands.attach_options import options_from
from sparseety_prof.session.options import METRICS_BIND, Options, Outputs
from sparseety_prof.session.policy import RecordingPolicy


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


@pytest.mark.parametrize("command", ["record", "attach"])
def test_the_parser_writes_no_default(command: str) -> None:
    for action in _subparser(command)._actions:
        if action.dest == "help":
            continue
        assert action.default is None, (command, action.option_strings, action.default)


@pytest.mark.parametrize("command", ["record", "attach"])
def test_every_flag_not_given_leaves_the_options_default(command: str) -> None:
    made = options_from(build_parser().parse_args([command, "-p", "7", "-o", "rec"]))
    default = Options(pid=7, out=Path("rec"))
    assert made == default  # every field, the outputs and the capture among them
    assert made.outputs == Outputs() and made.outputs.metrics_bind == METRICS_BIND
    assert made.capture == Capture()
    assert made.policy_choice == default.policy_choice  # not compared by ==: its own check


def test_a_flag_given_is_what_the_options_hold() -> None:
    """The counterpart: a value given differs from the default and reaches its field."""
    argv = ["record", "-p", "7", "-o", "rec", "--discover-timeout", "30", "--moe-read", "ops"]
    argv += ["--nice", "0", "--no-journal", "--metrics-port", "9464", "--status-interval", "0"]
    made = options_from(build_parser().parse_args(argv))
    default = Options(pid=7, out=Path("rec"))
    assert (made.discover_timeout, made.moe_read, made.nice, made.journal) == (30.0, "ops", 0, False)
    assert (default.discover_timeout, default.moe_read, default.nice, default.journal) != (
        30.0,
        "ops",
        0,
        False,
    )
    assert (made.outputs.metrics_port, made.outputs.status_interval) == (9464, 0.0)
    assert made.outputs.metrics_bind == METRICS_BIND


def test_the_policy_is_parsed_once_into_the_options_and_each_recording_gets_its_own() -> None:
    argv = ["record", "-p", "7", "-o", "rec", "--policy", "head:0.25"]
    made = options_from(build_parser().parse_args(argv))
    assert made.policy == ("head:0.25",)
    assert made.policy_choice.head_in_probes == 0.25  # head alone: drawn in the probes
    first = RecordingPolicy.for_session(made.policy_choice, made.policy_window)
    second = RecordingPolicy.for_session(made.policy_choice, made.policy_window)
    assert first.probe_verdicts == {} and second.probe_verdicts == {}
    assert first.probe_verdicts is not second.probe_verdicts  # --follow: one per process
    both = options_from(build_parser().parse_args([*argv, "--policy", "tail:0.9"]))
    assert both.policy_choice.head_in_probes is None  # tail decides at the end: every request captured
    assert RecordingPolicy.for_session(both.policy_choice, both.policy_window).probe_verdicts is None
