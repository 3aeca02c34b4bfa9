"""What the CLI and the UI make of the answers to actions on a running job.

The hub answers an action (``rtop.client.HubClient.act``) with every rank's own answer;
:func:`action_result` turns that into the action's public JSON (see the README), and
:func:`action_text` into text for a terminal. Each action's own module
(:mod:`rtop.actions.profile`, :mod:`rtop.actions.probe`, :mod:`rtop.actions.stacks`)
assembles and formats it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtop.fmt import fmt_ranks, safe_text

#: Characters of a rank's error kept in a result.
MAX_ERROR = 300


def action_result(out: dict[str, Any]) -> dict[str, Any]:
    """The public JSON of an action from the hub's answer (see the README)."""
    action = out.get("action")
    answers = {int(a["rank"]): a for a in out.get("answers") or []}
    errors = {int(e["rank"]): str(e["error"]) for e in out.get("errors") or []}
    missing = list(out.get("missing") or [])
    if action == "profile":
        from rtop.actions.profile import assemble as assemble_profile

        result = assemble_profile(answers, str(out.get("dir")), missing, errors)
    elif action == "stacks":
        from rtop.actions.stacks import assemble as assemble_stacks

        result = assemble_stacks(answers, missing, errors)
    else:
        result = dict(out.get("links") or {"ranks": out.get("ranks"), "nodes": out.get(
            "nodes"), "matrix_Bps": None, "findings": []})
        result["errors"] = {str(r): e for r, e in errors.items()}
        result["missing"] = missing
    if out.get("cancelled"):
        result["cancelled"] = out["cancelled"]
    return result


def answer_problems(result: Mapping[str, Any]) -> list[str]:
    """Lines on the ranks of a result that did not answer in time (``missing``) and the
    ranks whose action failed (``errors``)."""
    out: list[str] = []
    missing = result.get("missing") or []
    if missing:
        out.append(f"no answer in time from {'rank' if len(missing) == 1 else 'ranks'} "
                   f"{fmt_ranks(missing)}")
    for r, msg in (result.get("errors") or {}).items():
        out.append(f"rank {safe_text(str(r), 16)}: {safe_text(str(msg), MAX_ERROR)}")
    return out


def action_text(action: str, result: dict[str, Any], *, all_threads: bool = False) -> str:
    """An action's result as text for the terminal."""
    if action == "profile":
        from rtop.actions.profile import format_text as profile_text

        text = profile_text(result)
    elif action == "stacks":
        from rtop.actions.stacks import format_text as stacks_text

        text = stacks_text(result, all_threads=all_threads)
    else:
        from rtop.actions.probe import format_text as probe_text

        text = probe_text(result)
        for r, e in sorted((result.get("errors") or {}).items()):
            text += f"\nrank {r}: {safe_text(str(e))}"
        if result.get("missing"):
            text += f"\nno answer from rank(s) {fmt_ranks(result['missing'])}"
    if result.get("cancelled"):
        text += f"\ncancelled: {safe_text(str(result['cancelled']))}"
    return text
