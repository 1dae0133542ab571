"""The terminal report of a diff: the summary, one line per request pair, the first divergence
in context, the FFN layers whose activation sparsity moved most, and the verdict."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sparseety_prof.terminal_text import text, visible
from sparseety_prof.views.diff.result import ATTN, FFN, MOE, DiffResult, PairResult, TokenRef, Where
from sparseety_prof.views.diff.text import describe_token, num, pct


def _at(w: Where | None, kind: str | None = None) -> str:
    if w is None:
        return ""
    s = f"request #{w.pair} token {w.decode_order}"
    if w.layer is not None and kind is not None:
        s += f", {w.layer.label(kind)}"
    return s


def _lp(t: TokenRef | None) -> str:
    return "—" if t is None or t.log_prob is None else f"{t.log_prob + 0.0:.4f}"  # no "-0.0000"


def _token_cell(t: TokenRef | None) -> Text:
    if t is None or t.token_id is None:
        return Text("—", style="dim")
    if t.text is None:  # redacted: the id is all there is
        return Text(f"#{t.token_id}")
    return Text.assemble(f"'{visible(t.text)}'", (f" #{t.token_id}", "dim"))


def _summary(result: DiffResult, name_a: str, name_b: str) -> Table:
    tol = result.tolerances
    head = Table(title="sparseety-prof diff", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()

    def row(label: str, value: str | Text) -> None:  # values quote the recordings: Text, never markup
        head.add_row(label, value if isinstance(value, Text) else text(value))

    row("A", name_a)
    row("B", name_b)
    sa, sb = result.a, result.b
    req = f"A {sa.requests}, B {sb.requests}; {len(result.pairs)} paired by first-token time"
    if result.unpaired_a or result.unpaired_b:
        req += f"; unpaired: A {len(result.unpaired_a)}, B {len(result.unpaired_b)}"
    if sa.partial_requests or sb.partial_requests:
        req += f" (partial excluded: A {sa.partial_requests}, B {sb.partial_requests})"
    row("requests", req)
    rule = "all aligned positions" if result.all_positions else "up to each pair's divergence"
    row("tokens compared", f"{result.tokens_compared} ({rule})")
    fd = result.first_divergence
    row(
        "token divergence",
        f"{result.pairs_diverged} of {len(result.pairs)} pairs"
        + (f"; first: {_at(fd)}" if fd is not None else ""),
    )
    lp = result.log_prob
    row(
        "log-prob",
        f"max |Δ| {num(lp.max_abs_delta)}"
        + (f" at {_at(lp.max_at)}" if lp.max_at and lp.max_abs_delta else "")
        + f"; {lp.beyond_tol} of {lp.compared} beyond {tol.logprob:g}",
    )
    rt = result.routing
    if rt is not None:
        line = (
            f"agreement {pct(rt.agreement)} identical, {pct(rt.set_agreement)} as sets "
            f"({rt.compared} token×layer)"
        )
        if rt.first_difference:
            g = rt.first_difference
            line += f"; first set difference: {_at(g.where, MOE)}: {g.experts_a} vs {g.experts_b}"
        row("routing", line)
        row(
            "expert weights",
            f"max |Δ| {num(rt.max_weight_delta)}"
            + (f" at {_at(rt.max_weight_at, MOE)}" if rt.max_weight_at and rt.max_weight_delta else "")
            + f"; {rt.weights_beyond_tol} of {rt.weights_compared} beyond {tol.weight:g}",
        )
    z = result.act_zero_ratio
    if z is not None:
        worst = max(z.layers, key=lambda x: x.mean_abs_delta, default=None)
        line = f"mean |Δ| {num(z.mean_abs_delta)}, max {num(z.max_abs_delta)}"
        if z.max_at and z.max_abs_delta:
            line += f" at {_at(z.max_at, FFN)}"
        if worst is not None and worst.mean_abs_delta:
            line += f"; worst layer {worst.layer.label(FFN)} (mean {num(worst.mean_abs_delta)})"
        line += f"; {z.beyond_tol} of {z.compared} beyond {tol.ratio:g}"
        row("act zero ratio", line)
    at = result.attn
    if at is not None:
        line = f"{at.differing} of {at.compared} token×layer differ"
        if at.first_difference:
            ad = at.first_difference
            line += f"; first: {_at(ad.where, ATTN)}: {ad.attended_a} vs {ad.attended_b} cells"
        row("attention", line)
    for column, why in result.not_comparable.items():
        row("not comparable", f"{column}: {why}")
    return head


def _pairs_table(result: DiffResult) -> Table:
    caption = "cmp: positions compared; |Δlp|: largest |Δ log-prob|"
    t = Table(title="request pairs (by first-token time)", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("#", "requests A / B", "tokens", "cmp", "diverges", "|Δlp|"):
        t.add_column(c, overflow="fold")
    if result.routing is not None:
        t.add_column("experts=", overflow="fold")
        caption += "; experts=: token×MoE-layer with the same expert set"
    if result.act_zero_ratio is not None:
        t.add_column("|Δzero|", overflow="fold")
        caption += "; |Δzero|: largest |Δ act_zero_ratio|"
    if result.attn is not None:
        t.add_column("attn≠", overflow="fold")
        caption += "; attn≠: token×attention-layer with other attended cells"
    t.add_column("first difference", overflow="fold")
    t.caption = caption
    for p in result.pairs:
        cells: list[str | Text] = [
            str(p.pair),
            text(f"{p.request_a} / {p.request_b}"),
            f"{p.tokens_a}/{p.tokens_b}",
            str(p.compared),
            "—" if p.divergence is None else f"at {p.divergence}",
            num(p.log_prob.max_abs_delta),
        ]
        if result.routing is not None:
            cells.append(pct(p.routing.set_agreement) if p.routing else "—")
        if result.act_zero_ratio is not None:
            cells.append(num(p.act_zero_ratio.max_abs_delta) if p.act_zero_ratio else "—")
        if result.attn is not None:
            cells.append(str(p.attn.differing) if p.attn else "—")
        pf = p.first_difference
        cells.append(
            Text("equal", style="green")
            if pf is None
            else Text(f"{pf.kind} at {pf.decode_order}", style="red")
        )
        t.add_row(*cells)
    return t


def _pair_line(p: PairResult) -> Text | None:
    """A differing pair's first difference in words (None for an equal pair)."""
    pf = p.first_difference
    if pf is None:
        return None
    line = Text(f"#{p.pair} ", style="bold")
    line.append(visible(f"{p.request_a} / {p.request_b}: "))
    line.append(visible(f"first difference at token {pf.decode_order} ({pf.kind}): {pf.detail}"), style="red")
    if p.divergence is not None and pf.kind != "token":
        line.append(f"; tokens diverge at {p.divergence}: token {describe_token(p.token_a)} in A, ")
        line.append(f"{describe_token(p.token_b)} in B")
    return line


def _print_context(con: Console, shown: PairResult, all_positions: bool) -> None:
    """The tokens of both runs around a pair's divergence (or first difference)."""
    sf = shown.first_difference
    title = (
        f"request #{shown.pair} ({shown.request_a} / {shown.request_b}) "
        + (f"diverges at token {shown.divergence}" if shown.divergence is not None else "")
        + (
            f"; first difference at token {sf.decode_order} ({sf.kind})"
            if sf is not None and (shown.divergence is None or sf.decode_order < shown.divergence)
            else ""
        )
    )
    con.print(text(title, "bold"))
    ctx = Table()
    for col in ("token", "A", "A log-prob", "B", "B log-prob", ""):
        ctx.add_column(col)
    for row in shown.context:
        mark = ""
        if row.decode_order == shown.divergence:
            mark = "◀ diverge"
        elif sf is not None and row.decode_order == sf.decode_order:
            mark = f"◀ {sf.kind}"
        style = "bold red" if row.decode_order == shown.context_at else None
        ctx.add_row(
            str(row.decode_order),
            _token_cell(row.a),
            _lp(row.a),
            _token_cell(row.b),
            _lp(row.b),
            mark,
            style=style,
        )
    con.print(ctx)
    if shown.divergence is not None and not all_positions:
        con.print(
            Text(
                "after the divergence the runs condition on different tokens: later positions are not "
                "compared (use --all to compare them anyway)",
                style="dim",
            )
        )


def _ratio_layers(result: DiffResult) -> Table | None:
    """The FFN layers with the largest mean |Δ act_zero_ratio| (None when nothing moved)."""
    z = result.act_zero_ratio
    if z is None or not any(x.mean_abs_delta for x in z.layers):
        return None
    lt = Table()
    for col in ("layer", "compared", "mean |Δ|", "max |Δ|", f"> {result.tolerances.ratio:g}"):
        lt.add_column(col)
    for x in sorted(z.layers, key=lambda x: -x.mean_abs_delta)[:8]:
        lt.add_row(
            text(x.layer.label(FFN)),
            str(x.compared),
            num(x.mean_abs_delta),
            num(x.max_abs_delta),
            str(x.beyond_tol),
        )
    return lt


def _verdict(result: DiffResult) -> Text:
    if result.equal:
        return Text("the runs are equal within tolerances", style="bold green")
    reasons: list[str] = []
    if result.pairs_different:
        reasons.append(f"{result.pairs_different} of {len(result.pairs)} request pairs differ")
    if result.unpaired_a or result.unpaired_b:
        reasons.append("request counts differ")
    return Text("the runs differ: " + "; ".join(reasons), style="bold red")


def render(
    result: DiffResult, console: Console | None = None, *, name_a: str = "A", name_b: str = "B"
) -> None:
    """The terminal report: summary, one line per request pair, the first divergence in context."""
    con = console or Console()
    con.print(_summary(result, name_a, name_b))
    if result.pairs:
        con.print(_pairs_table(result))
        for p in result.pairs:
            line = _pair_line(p)
            if line is not None:
                con.print(line)

    # The context of the first pair whose tokens diverge, else of the first that differs at all.
    shown = next((p for p in result.pairs if p.divergence is not None), None)
    shown = shown or next((p for p in result.pairs if p.first_difference is not None), None)
    if shown is not None and shown.context:
        _print_context(con, shown, result.all_positions)

    layers = _ratio_layers(result)
    if layers is not None:
        con.print(Text("activation zero ratio by layer (largest mean |Δ| first)", style="bold"))
        con.print(layers)

    for note in result.notes:
        con.print(text(f"note: {note}", "yellow"))
    if result.unpaired_a or result.unpaired_b:
        con.print(text(f"unpaired: A {result.unpaired_a}, B {result.unpaired_b}", "yellow"))
    con.print(_verdict(result))
