"""Prometheus exposition of a hub snapshot (``GET /metrics`` with the hub's view token:
the one token a scraper may hold, since it can never act on the job).

The text is written by ``prometheus_client`` itself: :class:`SnapshotCollector` turns
one snapshot into metric families and :func:`prometheus_text` renders it on a registry
of its own (never the global one: one process may hold several hubs). Every series
carries the training job's id as ``job`` (see :class:`SnapshotCollector`) and, per
rank, ``rank`` and ``node``; counters end in ``_total``. A figure that was not
measured (None, NaN, infinite) is left out, never written as 0. Names come from the
ranks, so they are cleaned and cut to :data:`LABEL_MAX` characters before
``prometheus_client`` escapes them.

A rank's distributions (p50, p95 and p99 of its step time, data wait and exposed comm
over its rolling window of steps, ``collectors.figures.distribution``) are Summary
families, one sample per quantile (``quantile`` label), as a client-side Summary gives
them: the hub holds each rank's exact quantiles over a sliding window, which is what a
Summary means. A Histogram would need bucket bounds fixed in advance that suit every
job's step time (a millisecond to minutes) and cumulative counts per bucket the hub does
not keep; its one advantage, adding buckets up across ranks, is what the fleet view
already shows. The Summaries carry no ``_count`` and ``_sum``: those would have to be
cumulative over the run, and the hub keeps windows (``rtop_steps_total`` counts steps).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from collectors.figures import figures
from rtop.fmt import num, safe_text
from rtop.run.snapshot import Snapshot

#: The longest label value written (a name from a rank is cut, with "…", beyond it).
LABEL_MAX = 128


@dataclass(frozen=True)
class Series:
    """One metric family over a column of the snapshot's ranks (``RankColumns``)."""

    name: str  # the exposed name, its unit last (a counter gets ``_total`` on output)
    column: str
    help: str
    scale: float = 1.0  # to the unit the name says (MHz → hertz)
    offset: float = 0.0  # added after scaling (the step counter from 0 → steps done)


#: Per-rank gauges: medians over each rank's recent steps, latest samples otherwise
#: (the figures' ``prometheus``, ``collectors.figures``).
RANK_GAUGES = tuple(Series(p.name, f.name, p.help, p.scale, p.offset)
                    for f in figures() for p in f.prometheus
                    if not p.counter and p.quantile is None)

#: Per-rank counters (``_total`` is added on output).
RANK_COUNTERS = tuple(Series(p.name, f.name, p.help, p.scale, p.offset)
                      for f in figures() for p in f.prometheus if p.counter)

def _rank_summaries() -> dict[str, tuple[str, tuple[tuple[float, Series], ...]]]:
    out: dict[str, tuple[str, tuple[tuple[float, Series], ...]]] = {}
    for f in figures():
        for p in f.prometheus:
            if p.quantile is not None:
                text, quantiles = out.get(p.name, (p.help, ()))
                out[p.name] = (text, (*quantiles, (p.quantile, Series(
                    p.name, f.name, p.help, p.scale, p.offset))))
    return out


#: Per-rank Summaries (see the module doc): by name, its help and its quantiles, each
#: with the snapshot column it reads, lowest quantile first.
RANK_SUMMARIES = _rank_summaries()

#: The job's throughput (the diagnosis' overview, ``rtop.analysis.throughput``): gauge
#: name, its key in the overview's ``throughput``, help.
JOB_RATES = (
    ("rtop_job_samples_per_second", "samples_per_s",
     "Samples per second of the job (one rank per model replica, recent steps)"),
    ("rtop_job_tokens_per_second", "tokens_per_s",
     "Tokens per second of the job (one rank per model replica, recent steps)"),
    ("rtop_job_model_flops_per_second", "model_flops_per_s",
     "Model FLOPs per second of the job, every rank's summed (recent steps)"),
    ("rtop_job_mfu_ratio", "mfu",
     "Model FLOPs utilization: model FLOP/s over the GPUs' dense peak at the job's "
     "precision (0 to 1)"),
)

#: The hub's own counters (``HubInfo.counters`` and what the hub adds), as
#: ``rtop_hub_<name>_total``; a counter not listed here is exposed with a plain help.
HUB_COUNTERS = {
    "connections": "Connections accepted",
    "refused": "Connections and scrapes refused for a wrong or missing token",
    "bad_frames": "Frames that failed to decode or validate",
    "floods": "Connections closed for sending too much",
    "silent": "Connections closed for silence",
    "snapshots_skipped": "Snapshots not sent to a slow viewer",
    "snapshots_sent": "Snapshots sent to viewers",
    "forbidden": "Frames refused because the role may not send them",
    "unauthenticated_timeouts": "Connections closed before authenticating in time",
    "busy": "Connections refused at the hub's limits",
    "throttled": "Connections refused from an address that failed too often",
    "http_timeouts": "HTTP requests not whole in time",
    "actions": "Control actions run",
    "action_errors": "Control actions that failed",
    # spools: records ranks kept on disk when no hub took them at their end
    "spools": "Spool files taken in and recorded",
    "spool_records": "Records taken in from spool files",
    "spool_dropped_records": "Records the ranks left out of their spool files (its size "
                             "or time bound)",
    "spools_bad": "Spool files that could not be read (renamed .bad)",
    "spools_damaged": "Spool files taken in damaged (their whole frames before the damage "
                      "recorded)",
    "recorder_stalls": "Times the recorder's process fell rtop.hub.recorder.BACKLOG_BYTES "
                       "behind (the hub stopped reading its ranks until it caught up)",
    "recorder_stalled_ms": "Milliseconds the recorder's process was that far behind",
    "recorder_waits": "Of those, the times the hub's loop waited for it (the memory's bound "
                      "of last resort: twice BACKLOG_BYTES)",
    "ingest_pauses": "Times the hub stopped reading its ranks (its recorder's process "
                     "behind)",
    "ingest_deferred": "Reads of a rank's or relay's data that waited for a later pass of "
                       "the hub's loop (rtop.hub.server.INGEST_SLICE_S)",
    "ingest_behind": "Times the hub fell behind its ranks' data (no rank is taken for "
                     "silent until it catches up)",
    "ingest_behind_ms": "Milliseconds the hub was behind its ranks' data",
    "ingest_paused_ms": "Milliseconds the hub did not read its ranks (no rank is taken for "
                        "silent meanwhile)",
    "spools_pruned": "Spool files no hub recorded that the hub removed (past their time or "
                     "the spools' byte budget): their records are lost",
}


def _label(value: Any) -> str:
    """A label value from a peer: control characters replaced, at most LABEL_MAX long
    (``prometheus_client`` then escapes quotes, backslashes and newlines)."""
    return safe_text(str(value), LABEL_MAX)


def _name_part(key: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in key)


class SnapshotCollector(Collector):
    """The metric families of one hub snapshot (``collect`` may run any number of
    times; the snapshot is never changed).

    Every series is labelled ``job`` with the job's id (the hub's name for it before a
    rank says); with neither, the label is left out, so that a Prometheus with
    ``honor_labels: true`` files the series under its scrape job instead.
    """

    def __init__(self, snap: Snapshot, hub_counters: Mapping[str, int] | None = None
                 ) -> None:
        self.snap = snap
        self.hub_counters = dict(hub_counters or {})
        run = snap["run"]
        job = _label(run.get("job") or run.get("name") or "")
        self._job_keys: tuple[str, ...] = ("job",) if job else ()
        self._job: list[str] = [job] if job else []

    def _family(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                text: str, *keys: str) -> GaugeMetricFamily | CounterMetricFamily:
        return kind(name, text, labels=(*self._job_keys, *keys))

    def collect(self) -> Iterator[Metric]:
        """Per-rank gauges and counters, rank liveness, findings, the hub's own cost."""
        yield from self._ranks()
        yield from self._findings()
        yield from self._run()

    def _ranks(self) -> Iterator[Metric]:
        cols = cast(Mapping[str, list[Any]], self.snap["ranks"])
        ranks = cols.get("rank") or []
        nodes = cols.get("node") or []
        labels = [[*self._job, str(r), _label(nodes[i] if i < len(nodes) else "")]
                  for i, r in enumerate(ranks)]
        for kind, table in ((GaugeMetricFamily, RANK_GAUGES),
                            (CounterMetricFamily, RANK_COUNTERS)):
            for s in table:
                family = self._family(kind, s.name, s.help, "rank", "node")
                values = cols.get(s.column) or []
                for i, lab in enumerate(labels):
                    v = num(values[i]) if i < len(values) else None
                    if v is None:
                        continue
                    v = v * s.scale + s.offset
                    if v >= 0 or kind is GaugeMetricFamily:  # a count is never below 0
                        family.add_metric(lab, v)
                if family.samples:  # no rank measured it: no family at all
                    yield family
        yield from self._summaries(cols, labels)
        up = self._family(GaugeMetricFamily, "rtop_rank_up", "1 if the rank is sending, "
                          "0 if it is lost, finished or failed", "rank", "node")
        status = cols.get("status") or []
        for i, lab in enumerate(labels):
            up.add_metric(lab, 1.0 if i < len(status) and status[i] == "active" else 0.0)
        yield up

    def _summaries(self, cols: Mapping[str, list[Any]], labels: list[list[str]]
                   ) -> Iterator[Metric]:
        """The distributions, one Summary family each (quantile samples only)."""
        keys = {**dict.fromkeys(self._job_keys, ""), "rank": "", "node": ""}
        for name, (text, quantiles) in RANK_SUMMARIES.items():
            family = SummaryMetricFamily(name, text, labels=tuple(keys))
            for q, s in quantiles:
                values = cols.get(s.column) or []
                for i, lab in enumerate(labels):
                    v = num(values[i]) if i < len(values) else None
                    if v is not None:
                        family.add_sample(name, {**dict(zip(keys, lab, strict=True)),
                                                 "quantile": f"{q:g}"},
                                          v * s.scale + s.offset)
            if family.samples:
                yield family

    def _findings(self) -> Iterator[Metric]:
        findings = self.snap.get("findings") or []
        by_kind: dict[tuple[str, str], int] = {}
        for f in findings:
            key = (_label(f.get("kind", "?")), _label(f.get("severity", "?")))
            by_kind[key] = by_kind.get(key, 0) + max(1, len(f.get("ranks") or []))
        each = self._family(GaugeMetricFamily, "rtop_finding", "Active finding by kind and "
                            "severity: the number of ranks it names (1 for the job as a "
                            "whole)", "kind", "severity")
        for (kind, severity), n in sorted(by_kind.items()):
            each.add_metric([*self._job, kind, severity], float(n))
        if each.samples:
            yield each
        total = self._family(GaugeMetricFamily, "rtop_findings", "Active findings")
        total.add_metric(self._job, float(len(findings)))
        yield total

    def _run(self) -> Iterator[Metric]:
        snap, run = self.snap, self.snap["run"]
        rates = cast(Mapping[str, Any], (snap.get("overview") or {}).get("throughput") or {})
        gauges = (
            ("rtop_world_size", run.get("world_size"), "Ranks the job says it has"),
            ("rtop_ranks", run.get("ranks_seen"), "Ranks of the current attempt seen"),
            ("rtop_attempt", run.get("attempt"), "The current attempt (worker group), from 0"),
            ("rtop_hub_uptime_seconds", run.get("uptime_s"), "Seconds the hub has run"),
            ("rtop_hub_snapshot_build_seconds", snap.get("build_s"),
             "Seconds the hub took to build the snapshot's columns (rtop's own cost)"),
            ("rtop_hub_analysis_seconds", snap.get("analysis_s"),
             "Seconds the hub's last diagnosis took (rtop's own cost)"),
            *((name, rates.get(key), text) for name, key, text in JOB_RATES),
        )
        counters: list[tuple[str, Any, str]] = [
            ("rtop_hub_frames", run.get("frames"), "Frames the hub has taken in"),
            ("rtop_hub_step_records", run.get("step_records"),
             "Step records the hub has taken in")]
        hub = snap.get("hub") or {}
        merged = {**(hub.get("counters") or {}), **self.hub_counters}
        counters += [(f"rtop_hub_{_name_part(key)}", value,
                      HUB_COUNTERS.get(key, f"The hub's {_name_part(key)} counter"))
                     for key, value in sorted(merged.items())]
        for kind, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, value, text in rows:
                v = num(value)
                if v is not None:
                    family = self._family(kind, name, text)
                    family.add_metric(self._job, v)
                    yield family


def prometheus_text(snap: Snapshot, hub_counters: Mapping[str, int] | None = None) -> str:
    """Prometheus text format (0.0.4) for a snapshot, written by ``prometheus_client``
    on a registry of its own; ``hub_counters`` adds counters that the snapshot does not
    carry (the hub's action counters), as ``rtop_hub_<name>_total``."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(snap, hub_counters))
    return generate_latest(registry).decode()
