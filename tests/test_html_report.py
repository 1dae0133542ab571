"""`report DIR --html FILE`: the page opened in headless Chromium (no console message at all, every
panel there, a screenshot kept under tests/artifacts/), its numbers compared with the engine's
ground truth and the recording parsed independently, hostile text that stays text, recordings
without routing or sparsity, the bounds of a long recording, and the output file's rules."""

from __future__ import annotations

import re
import signal
import stat
from pathlib import Path

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder
from headless_chromium import Dom, Opened, open_page
from test_recording import steps_frame, tokens_frame

import sparseety_prof
from sparseety_prof import cli
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.views.html_report.data import MAX_EXPERTS, STEP_POINTS, TOKEN_CAP
from sparseety_prof.views.html_report.page import CSP

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"  # .gitignored
PANELS = (
    "expert-load",
    "load-imbalance",
    "routing",
    "sparsity",
    "logprob",
    "steps",
    "cpu",
    "anomalies",
    "tokens",
)
HOSTILE = [
    "<script>alert(1)</script>",
    "</style><img src=x onerror=alert(2)>",
    "</title><svg onload=alert(3)>",
    "\"'><iframe src=https://evil.example/></iframe>",
    "<!-- ]]> &amp; &lt;b&gt;",
    "bidi\u202e\x1b[2J<u>",  # hidden characters are spelled out, as in the terminal
]
SHOWN = {"bidi\u202e\x1b[2J<u>": "bidi\\u202e\\x1b[2J<u>"}
HOSTILE_META = {
    "pid": 4242,
    "engine": {"name": "<script>alert('engine')</script>", "version": "</style>"},
    "model": {"name": "</title><script>alert('model')</script>", "architecture": "<b>x</b>"},
    "layers": {"moe": [1, 3], "ffn": [0, 1], "attn": [0, 1]},
    "act_threshold": 0.01,
}


def html_report(rec: Path, out: Path, *extra: str) -> int:
    return cli.main(["report", str(rec), "--html", str(out), *extra])


def render_and_open(rec: Path, name: str) -> tuple[Path, Opened, Dom]:
    """Write the page, open it in Chromium (screenshot kept as tests/artifacts/NAME.png), and
    check what every page must be: no console message, every panel present."""
    out = rec.parent / f"{name}.html"
    assert html_report(rec, out) == 0
    ARTIFACTS.mkdir(exist_ok=True)
    opened = open_page(out, ARTIFACTS / f"html_report_{name}.png")
    print(f"screenshot: {opened.screenshot}")
    assert opened.console == [], opened.console
    dom = Dom(opened.dom)
    ids = [v for tag, k, v in dom.attrs if tag == "section" and k == "id"]
    assert ids == list(PANELS)
    assert not {"script", "iframe", "img", "object", "embed"} & set(dom.tags)
    assert not [a for a in dom.attrs if a[1].startswith("on")]
    return out, opened, dom


# ------------------------------------------------------------------ the console capture itself
def test_the_console_capture_sees_errors(tmp_path: Path) -> None:
    """The capture the other tests rely on: a console.error, an uncaught exception, and the CSP
    refusal of a script in a page with the report's policy each show up (a Chromium that stopped
    logging them would pass every page)."""
    page = tmp_path / "canary.html"
    page.write_text(
        "<!DOCTYPE html><html><head><title>c</title></head><body><p>x</p>"
        '<script>console.error("canary-error"); throw new Error("canary-throw");</script></body></html>'
    )
    got = open_page(page, tmp_path / "canary.png").console
    assert any("canary-error" in m for m in got), got
    assert any("Uncaught Error: canary-throw" in m for m in got), got
    page.write_text(
        f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<title>c</title></head><body><p>x</p><script>console.log("ran")</script></body></html>'
    )
    got = open_page(page, tmp_path / "canary.png").console
    # (each of the two Chromium runs reports it; the script never ran)
    assert got and all("violates the following Content Security Policy" in m for m in got), got


# ------------------------------------------------------------------ crafted recordings
def _write(path: Path, tokens: pl.DataFrame, steps: pl.DataFrame, meta: dict[str, object]) -> Path:
    with RecordingWriter(path, meta) as w:
        w.append("tokens", tokens)
        w.append("steps", steps)
    return path


def test_hostile_text_stays_text_in_the_browser(tmp_path: Path) -> None:
    t = tokens_frame(40)
    t = t.with_columns(
        pl.Series("request_id", [f"<b>req{s}</b><script>alert(0)</script>" for s in t["seq_id"].to_list()]),
        pl.Series(
            "token_text", [HOSTILE[(i // 2) % len(HOSTILE)] for i in range(t.height)]
        ),  # all in each request
    )
    rec = _write(tmp_path / "rec", t, steps_frame(20), HOSTILE_META)
    out, _, dom = render_and_open(rec, "hostile")
    # what the recording holds is shown as text, exactly
    shown = [r[2] for r in dom.table("tokens")]
    want = t.filter(pl.col("request_id") == "<b>req0</b><script>alert(0)</script>")
    assert sorted(shown) == sorted(SHOWN.get(s, s) for s in want["token_text"].to_list())
    page_text = "".join(x for texts in dom.text.values() for x in texts)
    for s in [
        *(SHOWN.get(s, s) for s in HOSTILE),
        "<script>alert('engine')</script>",
        "</title><script>alert('model')</script>",
    ]:
        assert s in page_text
    assert dom.tags.count("style") == 1 and dom.tags.count("title") >= 1
    raw = out.read_bytes()
    assert raw.isascii() and b"\x1b" not in raw and b"\x00" not in raw


def test_the_page_fetches_nothing_and_runs_no_script(tmp_path: Path) -> None:
    t = tokens_frame(40).with_columns(pl.lit("https://evil.example/x.js").alias("token_text"))
    rec = _write(tmp_path / "rec", t, steps_frame(20), HOSTILE_META)
    out = tmp_path / "page.html"
    assert html_report(rec, out) == 0
    page = Dom(out.read_text())
    assert "script" not in page.tags
    for tag, name, value in page.attrs:
        assert name not in ("src", "href", "xlink:href", "action", "srcset", "background"), (tag, name)
        assert "://" not in value and "url(" not in value, (tag, name, value)
    css = out.read_text().split("<style>", 1)[1].split("</style>", 1)[0]
    assert "url(" not in css and "@import" not in css
    assert not re.search(r"(?:src|href)\s*=\s*[\"']?\s*https?://", out.read_text())
    csp = [v for tag, k, v in page.attrs if tag == "meta" and k == "content" and "default-src" in v]
    assert csp and "default-src 'none'" in csp[0] and "script-src" not in csp[0]


def test_expert_ids_out_of_range_are_left_out_and_said_so(tmp_path: Path) -> None:
    """A damaged or hostile recording's expert id 2**31-1 must not make a heat map that wide."""
    t = tokens_frame(40)
    t = t.with_columns(
        pl.Series("expert_ids", [[[2**31 - 1, 5], [-4, 2]]] * t.height, dtype=t["expert_ids"].dtype)
    )
    rec = _write(tmp_path / "rec", t, steps_frame(20), HOSTILE_META)
    out = tmp_path / "page.html"
    assert html_report(rec, out) == 0
    page = Dom(out.read_text())
    loads = _loads(page)
    assert {k: v for k, v in loads.items() if v} == {(1, 5): 40, (3, 2): 40}
    assert max(e for _, e in loads) == 5  # the heat map is as wide as the ids in range
    assert f"80 selections of an expert id outside 0-{MAX_EXPERTS - 1}" in "".join(page.text["expert-load"])
    assert out.stat().st_size < 200_000


def test_a_recording_without_tokens_or_steps_renders_its_notes(tmp_path: Path) -> None:
    rec = _write(tmp_path / "rec", tokens_frame(0), steps_frame(0), HOSTILE_META)
    _, _, dom = render_and_open(rec, "empty")
    for panel in PANELS:
        if panel != "anomalies":
            assert dom.missing.get(panel) and dom.missing[panel][0].startswith("not captured"), panel


def test_a_long_request_is_capped_and_says_so(tmp_path: Path) -> None:
    n_steps = STEP_POINTS + 500  # two requests of n_steps tokens; r0-0-0 comes first
    rec = _write(tmp_path / "rec", tokens_frame(2 * n_steps), steps_frame(n_steps), HOSTILE_META)
    out = tmp_path / "long.html"
    assert html_report(rec, out) == 0
    page = Dom(out.read_text())
    rows = page.table("tokens")
    assert len(rows) == TOKEN_CAP
    # the longest request's first TOKEN_CAP tokens in decode order (tokens_frame leaves some
    # without one: those come last)
    mine = sparseety_prof.open(rec).tokens().filter(pl.col("request_id") == "r0-0-0")
    assert [int(r[0]) for r in rows] == sorted(mine["decode_order"].drop_nulls().to_list())[:TOKEN_CAP]
    tokens_note = "".join(page.text["tokens"])
    assert f"the first {TOKEN_CAP} of the request's {n_steps} tokens" in tokens_note
    assert f"binned by 2 (at most {STEP_POINTS} points)" in "".join(page.text["steps"])
    assert out.stat().st_size < 3_000_000


# ------------------------------------------------------------------ the output file
def test_the_file_is_owner_only_and_never_overwritten_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _write(tmp_path / "rec", tokens_frame(8), steps_frame(4), HOSTILE_META)
    out = tmp_path / "r.html"
    out.write_text("keep me")
    assert html_report(rec, out) == 2
    assert out.read_text() == "keep me" and "--force" in capsys.readouterr().err
    assert html_report(rec, out, "--force") == 0
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "rec"]  # no temporary file left
    assert html_report(rec, tmp_path / "x.html", "--request", "nope\x1b[2J") == 2
    err = capsys.readouterr().err
    assert "no request 'nope\\x1b[2J'" in err and "\x1b" not in err
    assert not (tmp_path / "x.html").exists()
    assert cli.main(["report", str(rec), "--force"]) == 2  # --force goes with --html


# ------------------------------------------------------------------ real engines
PROMPTS = [("hello the expert router", 40), ("what is", 12)]


def _record(engine: Engine, out: Path, *extra: str) -> tuple[Path, list[dict[str, object]]]:
    rec = Recorder(engine.pid, out, *extra)
    truth = [engine.generate([p], max_tokens=n)[0] for p, n in PROMPTS]
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    return out, truth


@pytest.fixture(scope="module")
def recorded(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, list[dict[str, object]]]]:
    """One MoE engine recorded three ways (full, --mode tokens with --redact-text, --redact
    routing,sparsity) and one dense engine: two prompts each, the first the longer."""
    d = tmp_path_factory.mktemp("html")
    got = {}
    moe = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    try:
        # the CPU sampler above its default rate: the short generation gets samples for the flame graph
        got["moe"] = _record(moe, d / "moe", "--cpu-sample-hz", "999")
        got["tokens"] = _record(moe, d / "tokens", "--mode", "tokens", "--redact-text")
        got["redacted"] = _record(moe, d / "redacted", "--redact", "routing,sparsity")
    finally:
        moe.close()
    dense = Engine([str(ENGINES / "llama_engine.py"), str(models["dense"])])
    try:
        got["dense"] = _record(dense, d / "dense")
    finally:
        dense.close()
    return got


def _by_time(rec: sparseety_prof.Recording) -> list[str]:
    t = rec.tokens()
    return t.group_by("request_id").agg(pl.col("t_end_ns").min()).sort("t_end_ns")["request_id"].to_list()


def _loads(dom: Dom) -> dict[tuple[int, int], int]:
    out = {}
    for s in dom.titles.get("expert-load", []):
        m = re.fullmatch(r"layer (\d+), expert (\d+): (\d+) selections \(.*\)", s)
        assert m, s
        out[(int(m[1]), int(m[2]))] = int(m[3])
    return out


def _check_tokens(dom: Dom, ids: list[int], log_probs: list[float]) -> None:
    rows = dom.table("tokens")
    assert [int(r[3]) for r in rows] == ids
    assert [int(r[0]) for r in rows] == list(range(len(ids)))
    for r, lp in zip(rows, log_probs, strict=True):
        assert abs(float(r[4]) - lp) < 2e-3, (r, lp)


@pytest.mark.root
@pytest.mark.engine
def test_a_moe_recording_shows_the_engines_tokens_and_the_recorded_routing(
    recorded: dict[str, tuple[Path, list[dict[str, object]]]],
) -> None:
    path, truth = recorded["moe"]
    rec = sparseety_prof.open(path)
    _, _, dom = render_and_open(path, "moe")
    assert not dom.missing, dom.missing
    # the longest request by default: the first prompt's, unless the engine stopped it early
    order = _by_time(rec)
    longest = max(range(len(truth)), key=lambda i: (len(truth[i]["ids"]), -i))  # type: ignore[arg-type]
    _check_tokens(dom, truth[longest]["ids"], truth[longest]["log_probs"])  # type: ignore[arg-type]
    # experts per layer in the table: the request's token rows, layer by layer
    mine = rec.tokens().filter(pl.col("request_id") == order[longest]).sort("decode_order")
    moe_layers = rec.meta["layers"]["moe"]
    for r, experts in zip(dom.table("tokens"), mine["expert_ids"].to_list(), strict=True):
        assert r[5] == " · ".join(
            f"L{layer} {','.join(map(str, e))}" for layer, e in zip(moe_layers, experts, strict=True)
        )
    # the heat map's counts are the routes table's (every row computed), counted here apart
    want = (
        rec.routes()
        .select("layer", pl.col("expert_ids").alias("e"))
        .drop_nulls()
        .explode("e")
        .group_by("layer", "e")
        .len()
    )
    got = _loads(dom)
    assert {k: v for k, v in got.items() if v} == {(la, e): n for la, e, n in want.iter_rows()}
    assert {layer for layer, _ in got} == set(moe_layers)
    # --request selects the other one
    other = tmp = path.parent / "other.html"
    assert html_report(path, tmp, "--request", order[1 - longest]) == 0
    _check_tokens(Dom(other.read_text()), truth[1 - longest]["ids"], truth[1 - longest]["log_probs"])  # type: ignore[arg-type]


@pytest.mark.root
@pytest.mark.engine
def test_recordings_without_routing_or_sparsity_say_so_per_panel(
    recorded: dict[str, tuple[Path, list[dict[str, object]]]],
) -> None:
    path, truth = recorded["tokens"]
    _, _, dom = render_and_open(path, "mode_tokens")
    for panel in ("expert-load", "load-imbalance", "routing", "sparsity"):
        assert dom.missing[panel][0].startswith("not captured"), (panel, dom.missing)
    assert {r[2] for r in dom.table("tokens")} == {"redacted"}  # --redact-text
    _check_tokens(dom, truth[0]["ids"], truth[0]["log_probs"])  # type: ignore[arg-type]

    path, truth = recorded["redacted"]
    rec = sparseety_prof.open(path)
    _, _, dom = render_and_open(path, "redacted")
    assert dom.missing["routing"] == ["redacted (--redact routing)"]
    assert "coarsened by --redact sparsity" in "".join(dom.text["sparsity"])
    kept = rec.meta["redaction"]["expert_load"]
    want = {(int(layer), e): n for layer, v in kept.items() for e, n in enumerate(v["selections"]) if n}
    assert {k: v for k, v in _loads(dom).items() if v} == want

    path, truth = recorded["dense"]
    _, _, dom = render_and_open(path, "dense")
    assert dom.missing["expert-load"][0].startswith("not captured: the model has no MoE layers")
    assert dom.missing["routing"][0].startswith("not captured: the model has no MoE layers")
    assert "sparsity" not in dom.missing  # a dense FFN's activations are recorded
    _check_tokens(dom, truth[0]["ids"], truth[0]["log_probs"])  # type: ignore[arg-type]
