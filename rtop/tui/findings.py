"""The findings: worst first, one line each; the selected one's evidence and fix."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.text import Text
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from rtop.fmt import NA, safe_text
from rtop.run.snapshot import FindingDict

SEVERITY_STYLE = {"critical": ("‼", "bold white on red"), "warning": ("!", "bold yellow"),
                  "info": ("i", "cyan")}


def finding_line(f: FindingDict) -> Text:
    """``! straggler [1]  Rank 1 computes 2.1× …`` as one line."""
    glyph, style = SEVERITY_STYLE.get(f["severity"], ("?", ""))
    ranks = f["ranks"]
    shown = ",".join(str(r) for r in ranks[:6]) + ("…" if len(ranks) > 6 else "")
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f" {glyph} ", style)
    text.append(f" {f['kind']}", "bold")
    text.append(f" [{shown}] ", "dim")
    text.append(safe_text(f["summary"], 2000))
    return text


class FindingsList(OptionList):
    """The current findings; highlighting one shows its detail and its ranks."""

    DEFAULT_CSS = """
    FindingsList { height: auto; max-height: 7; border: none; padding: 0; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.findings: Sequence[FindingDict] = []

    def show(self, findings: Sequence[FindingDict]) -> None:
        """Replace the list, keeping the highlighted finding if it is still there."""
        keys = [(f["kind"], tuple(f["ranks"])) for f in findings]
        old = [(f["kind"], tuple(f["ranks"])) for f in self.findings]
        if keys == old:
            self.findings = findings
            return
        was = self.highlighted
        kind = self.findings[was]["kind"] if was is not None and \
            was < len(self.findings) else None
        self.findings = findings
        self.clear_options()
        self.add_options([Option(finding_line(f), id=f"{i}") for i, f in enumerate(findings)])
        if kind is not None:
            for i, f in enumerate(findings):
                if f["kind"] == kind:
                    self.highlighted = i
                    break

    @property
    def selected(self) -> FindingDict | None:
        """The highlighted finding."""
        i = self.highlighted
        return self.findings[i] if i is not None and 0 <= i < len(self.findings) else None


def _value(k: str, v: Any) -> str:
    """One evidence figure as people read it (the unit from its name)."""
    if v is None:
        return NA
    if isinstance(v, float):
        if k.endswith("_Bps"):
            return f"{v / 1e9:.3g} GB/s"
        if k.endswith("_bytes"):
            return f"{v / 1e9:.3g} GB"
        if k.endswith("_s") or "_s_" in k:
            if abs(v) < 1e-4:
                return "~0 ms"
            return f"{v * 1e3:.3g} ms" if v < 10 else f"{v:.3g} s"
        return f"{v:.3g}"
    if isinstance(v, list) and v and isinstance(v[0], dict):
        return "; ".join(", ".join(f"{a}={_value(a, b)}" for a, b in d.items()) for d in v[:6])
    if isinstance(v, dict):
        return ", ".join(f"{a}={_value(a, b)}" for a, b in list(v.items())[:8])
    if isinstance(v, str) and "\n" in v:
        return v.strip().splitlines()[-1]
    return json.dumps(v, default=str) if not isinstance(v, str) else v


def evidence_text(f: FindingDict) -> Text:
    """Summary, evidence (one line per figure; per-rank figures one line per rank) and
    the usual fix."""
    text = Text()
    glyph, style = SEVERITY_STYLE.get(f["severity"], ("?", ""))
    text.append(f" {glyph} {f['kind']} ", style)
    text.append(f"  ranks {', '.join(str(r) for r in f['ranks'][:32])}\n", "bold")
    text.append(safe_text(f["summary"], 2000) + "\n")
    for k, v in f["evidence"].items():
        if k == "ranks" and isinstance(v, dict):
            for r, figures in list(v.items())[:8]:
                text.append(f"  rank {r}: ", "bold")
                text.append(safe_text(_value("", figures), 2000) + "\n", "dim")
            continue
        if k == "stack":
            continue
        text.append(f"  {k}: ", "bold")
        text.append(safe_text(_value(k, v), 2000) + "\n", "dim")
    if f["fix"]:
        text.append("Fix: ", "bold green")
        text.append(safe_text(f["fix"], 2000))
    return text


class FindingDetail(Static):
    """The selected finding in full."""

    DEFAULT_CSS = """
    FindingDetail { height: auto; max-height: 12; padding: 0 1; background: $boost;
                    overflow-y: auto; }
    """
