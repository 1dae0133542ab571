"""`record` and `attach` share their flags and turn them into the same Options."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparseety_prof.cli import build_parser
from sparseety_prof.commands.attach_options import options_from as _options
from sparseety_prof.errors import UsageError


def test_shared_flags_reach_the_options() -> None:
    p = build_parser()
    for argv in (["record", "--pid", "7", "-o", "rec"], ["attach", "--pid", "7", "-o", "rec"]):
        o = _options(p.parse_args([*argv, "--duration", "2.5", "--redact-text", "--nice", "3"]))
        assert (o.pid, o.out, o.duration, o.redact_text, o.nice) == (7, Path("rec"), 2.5, True, 3)
    assert _options(p.parse_args(["attach", "--pid", "7"])).out is None
    assert _options(p.parse_args(["record", "--pid", "7", "-o", "r"])).nice == 10


def test_correlate_every_is_checked_and_off_by_default() -> None:
    p = build_parser()
    base = ["record", "--pid", "7", "-o", "r"]
    assert _options(p.parse_args(base)).correlate_every == 0
    assert _options(p.parse_args([*base, "--correlate-every", "1.5"])).correlate_every == 1.5
    for bad in ("-1", "11"):
        with pytest.raises(UsageError, match="--correlate-every"):
            _options(p.parse_args([*base, "--correlate-every", bad]))


def test_ablate_consumer_is_off_by_default() -> None:
    p = build_parser()
    for cmd in ("record", "attach"):
        base = [cmd, "--pid", "7", "-o", "r"]
        assert _options(p.parse_args(base)).ablate_consumer == ""
        assert _options(p.parse_args([*base, "--ablate-consumer"])).ablate_consumer == "drain"
        assert _options(p.parse_args([*base, "--ablate-consumer", "logits"])).ablate_consumer == "logits"
        with pytest.raises(SystemExit):  # argparse's usage error, exit 2
            p.parse_args([*base, "--ablate-consumer", "everything"])


def test_ablating_with_the_logits_statistics_needs_their_c_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ablate-consumer logits` measures the C statistics the recorder uses: without them (not
    built here), a usage error before anything is attached, not a floor measured on numpy."""
    from sparseety_prof.correlate.logits_reduce import LogitsReducer

    monkeypatch.setattr(LogitsReducer, "available", staticmethod(lambda: False))
    p = build_parser()
    with pytest.raises(UsageError, match="C backend"):
        _options(p.parse_args(["record", "--pid", "7", "-o", "r", "--ablate-consumer", "logits"]))
    assert _options(p.parse_args(["record", "--pid", "7", "-o", "r", "--ablate-consumer"])).ablate_consumer
