"""The analysis examples of sparseety_prof/views/examples.py (docs/usage.md) run as doctests."""

from __future__ import annotations

import doctest

from sparseety_prof.views import examples


def test_analysis_examples_run() -> None:
    result = doctest.testmod(examples, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0
    assert result.attempted >= 15  # every example ran, not an emptied docstring
