"""``/metrics`` through ``prometheus_client`` (issue 14), read back by its own parser and
scraped by a real Prometheus server (Debian's ``prometheus``, which ``.ci/run``
installs) on loopback.

What is checked: the text parses; per-rank series carry job, rank and node; counters
end in ``_total`` and grow; what was not measured (None, NaN, infinities) is absent,
never 0; hostile names are cleaned, escaped and cut; each call uses a registry of its
own; a real Prometheus with the view token as its bearer credentials file sees both
ranks of a real 2-rank job, one with a wrong token sees its target down (401), and the
master token is refused (403).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from collectors import auth
from rtop.client import HubClient
from rtop.hub.metrics import LABEL_MAX, prometheus_text
from rtop.hub.service import ThreadedHub
from rtop.workload import Faults, WorkloadSpec, run_local
from tests import waiting
from tests.rankclient import RankClient, gpu_row, step_row

#: This module's pace: scrapes polled every 200 ms.
wait_for = partial(waiting.wait_for, every=0.2)

ROOT = Path(__file__).resolve().parent.parent
MASTER = "prometheus-test-master-token-0123456789"
VIEW = auth.role_token(MASTER, "view")


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples called ``name`` in an exposition, by their sorted labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_rank(text: str, name: str) -> dict[str, float]:
    return {dict(k)["rank"]: v for k, v in samples(text, name).items()}


# ---- the text itself ----------------------------------------------------------------


@pytest.fixture
def snapshot() -> Iterator[dict[str, Any]]:
    """A real hub's snapshot (as a viewer gets it) of two hand-driven ranks: rank 0 with
    two steps and a GPU sample, rank 1 with one step and no GPU."""
    hub = ThreadedHub(record="", token=MASTER).start()
    ingest = auth.role_token(MASTER, "ingest")
    ranks = [RankClient(hub.address, ingest, r, world=2, job="unit-job", host=f"node-{r}")
             for r in (0, 1)]
    try:
        ranks[0].batch(steps=[step_row(0), step_row(1)], gpu=[gpu_row(80.0)])
        ranks[1].batch(steps=[step_row(0)])
        with HubClient(hub.address, VIEW) as c:
            assert wait_for(lambda: c.snapshot()["ranks"]["step"] == [1, 0], 10)
            yield dict(c.snapshot())
    finally:
        for r in ranks:
            r.close()
        hub.stop()


def test_text_parses_with_job_rank_node_and_counters(snapshot: dict[str, Any]) -> None:
    text = prometheus_text(snapshot)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    step = samples(text, "rtop_step_seconds")
    assert {tuple(sorted(dict(k).items())) for k in step} == {
        (("job", "unit-job"), ("node", "node-0"), ("rank", "0")),
        (("job", "unit-job"), ("node", "node-1"), ("rank", "1"))}
    assert all(v == pytest.approx(0.05) for v in step.values())
    # counters: typed as such, named _total
    assert families["rtop_steps"].type == "counter"
    assert by_rank(text, "rtop_steps_total") == {"0": 2.0, "1": 1.0}
    assert by_rank(text, "rtop_dropped_records_total") == {"0": 0.0, "1": 0.0}
    assert families["rtop_hub_connections"].type == "counter"
    assert samples(text, "rtop_hub_connections_total")  # the hub's own counters
    assert samples(text, "rtop_hub_refused_total")
    assert by_rank(text, "rtop_rank_up") == {"0": 1.0, "1": 1.0}
    # rtop's own cost
    (build,) = samples(text, "rtop_hub_snapshot_build_seconds").values()
    assert build == pytest.approx(snapshot["build_s"])
    # not measured is absent: rank 1 sent no GPU sample, nobody sent memory figures
    assert by_rank(text, "rtop_gpu_utilization_percent") == {"0": 80.0}
    assert by_rank(text, "rtop_gpu_sm_clock_hertz") == {"0": 1980e6}
    assert by_rank(text, "rtop_mem_peak_bytes") == {}
    assert "rtop_mem_peak_bytes{" not in text
    # counters the snapshot does not carry (the hub's action counters)
    more = prometheus_text(snapshot, {"actions": 3})
    assert list(samples(more, "rtop_hub_actions_total").values()) == [3.0]


def test_none_nan_and_infinities_are_left_out(snapshot: dict[str, Any]) -> None:
    snap = copy.deepcopy(snapshot)
    cols = snap["ranks"]
    cols["step_s"] = [float("nan"), 0.5]
    cols["compute_s"] = [float("inf"), None]
    cols["comm_s"] = [None, float("-inf")]
    cols["dropped"] = [None, 7]
    snap["analysis_s"] = float("nan")
    text = prometheus_text(snap)
    assert by_rank(text, "rtop_step_seconds") == {"1": 0.5}
    assert by_rank(text, "rtop_compute_seconds") == {}
    assert by_rank(text, "rtop_comm_seconds") == {}
    assert by_rank(text, "rtop_dropped_records_total") == {"1": 7.0}
    assert not samples(text, "rtop_hub_analysis_seconds")
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert math.isfinite(s.value), s
    assert "NaN" not in text and "Inf" not in text


def test_findings_by_kind_and_severity(snapshot: dict[str, Any]) -> None:
    snap = copy.deepcopy(snapshot)
    base = {"summary": "", "evidence": {}, "fix": "", "impact": 0.1, "since": 0.0,
            "until": 0.0, "duration_s": 0.0, "active": True}
    snap["findings"] = [
        {**base, "kind": "straggler", "ranks": [1], "severity": "warning"},
        {**base, "kind": "input_bound", "ranks": [0, 1], "severity": "critical"},
        {**base, "kind": "low_scaling_efficiency", "ranks": [], "severity": "info"}]
    text = prometheus_text(snap)
    got = {(dict(k)["kind"], dict(k)["severity"]): v
           for k, v in samples(text, "rtop_finding").items()}
    assert got == {("straggler", "warning"): 1.0, ("input_bound", "critical"): 2.0,
                   ("low_scaling_efficiency", "info"): 1.0}
    assert list(samples(text, "rtop_findings").values()) == [3.0]
    assert list(samples(prometheus_text(snapshot), "rtop_findings").values()) == [0.0]


def test_hostile_names_are_escaped_and_cut(snapshot: dict[str, Any]) -> None:
    snap = copy.deepcopy(snapshot)
    evil = 'a"b\\c\nd\re\x1b[31mf\x00g} 1\n# TYPE x counter'
    snap["ranks"]["node"] = [evil, "n" * 10_000]
    snap["run"]["job"] = 'job"\n' + "j" * 10_000
    text = prometheus_text(snap)
    assert len(text) < 100_000  # 10 kB names in every series would make megabytes
    for ch in "\r\x1b\x00":
        assert ch not in text
    for line in text.splitlines():  # nothing a name holds starts a line of its own
        assert line.startswith(("# HELP rtop_", "# TYPE rtop_", "rtop_")), line
    nodes = {dict(k)["rank"]: dict(k)["node"]
             for k in samples(text, "rtop_step_seconds")}
    assert nodes["0"].startswith('a"b\\c') and "}" in nodes["0"]  # quoted, not broken
    assert "\n" not in nodes["0"] and len(nodes["0"]) <= LABEL_MAX
    assert len(nodes["1"]) == LABEL_MAX and nodes["1"].endswith("…")
    (job,) = {dict(k)["job"] for k in samples(text, "rtop_rank_up")}
    assert job.startswith('job"') and len(job) <= LABEL_MAX and "\n" not in job


def test_job_label_falls_back_to_the_hubs_name_then_is_left_out(
        snapshot: dict[str, Any]) -> None:
    """Before a rank says which job it is, the hub's own name for it; with neither, no
    ``job`` label (a Prometheus with ``honor_labels`` then keeps its scrape job's)."""
    snap = copy.deepcopy(snapshot)
    snap["run"].update(job="", name="nightly")
    jobs = {dict(k)["job"] for k in samples(prometheus_text(snap), "rtop_rank_up")}
    assert jobs == {"nightly"}
    snap["run"].update(job="", name="")
    text = prometheus_text(snap)
    assert 'job="' not in text
    assert by_rank(text, "rtop_rank_up") == {"0": 1.0, "1": 1.0}
    assert list(samples(text, "rtop_findings").values()) == [0.0]


def test_own_registry_every_time(snapshot: dict[str, Any]) -> None:
    before = {m.name for m in REGISTRY.collect()}
    assert prometheus_text(snapshot) == prometheus_text(snapshot)
    assert {m.name for m in REGISTRY.collect()} == before
    assert not any(n.startswith("rtop_") for n in before)


# ---- a real Prometheus scraping a real job ----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A real Prometheus server on loopback, with its own storage, killed on close."""

    def __init__(self, binary: str, tmp: Path, config: str) -> None:
        self.port = free_port()
        (tmp / "prometheus.yml").write_text(config)
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)
        self.logfile = tmp / "prometheus.log"

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            return None
        return body.get("data") if body.get("status") == "success" else None

    def query(self, q: str) -> list[dict[str, Any]]:
        data = self.api("query", query=q)
        return list(data["result"]) if data else []

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self.log.close()


@pytest.fixture
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("no `prometheus` on PATH: install Debian's package "
                    "(apt-get install prometheus; .ci/run does)")
    return found


@pytest.mark.job
def test_real_prometheus_scrapes_a_real_job(prometheus_binary: str, tmp_path: Path) -> None:
    hub = ThreadedHub(record="", token=MASTER).start()
    stop = threading.Event()
    spec = WorkloadSpec(world_size=2, duration_s=120.0, hub=hub.address,
                        token=auth.role_token(MASTER, "ingest"), dim=64, hidden=128,
                        faults=Faults(all_loader_sleep_s=0.01))
    job = threading.Thread(target=run_local, args=(spec,),
                           kwargs={"timeout_s": 300, "check": False, "stop": stop},
                           daemon=True)
    job.start()
    prom: Prometheus | None = None
    try:
        # the README's quick start: `rtop token view` into a file only you can read
        env = dict(os.environ, RTOP_TOKEN=MASTER, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-m", "rtop.cli", "token", "view",
                              hub.address], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == VIEW, out.stderr
        for name, text in (("view.token", out.stdout), ("wrong.token", "rtop-view-nope\n")):
            fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        # the README's quick start, with a second job holding a wrong token
        prom = Prometheus(prometheus_binary, tmp_path, f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: rtop
    honor_labels: true
    authorization: {{type: Bearer, credentials_file: {tmp_path / 'view.token'}}}
    static_configs: [{{targets: ["{hub.address}"]}}]
  - job_name: wrong
    authorization: {{type: Bearer, credentials_file: {tmp_path / 'wrong.token'}}}
    static_configs: [{{targets: ["{hub.address}"]}}]
""")
        with HubClient(hub.address, VIEW) as c:
            assert wait_for(lambda: len(c.snapshot()["ranks"]["rank"]) == 2
                            and min(c.snapshot()["ranks"]["step"]) >= 3, 150), \
                "the job never reached the hub"
            job_id = c.snapshot()["run"]["job"]
        assert job_id

        def both_ranks() -> bool:
            found = {(r["metric"].get("rank"), r["metric"].get("job"))
                     for r in prom.query("rtop_step_seconds")}
            return {("0", job_id), ("1", job_id)} <= found

        assert wait_for(both_ranks, 60), (
            prom.query("rtop_step_seconds"), prom.logfile.read_text()[-3000:])
        series = prom.query("rtop_step_seconds")
        assert {r["metric"]["node"] for r in series}  # and the node label
        assert all(float(r["value"][1]) > 0 for r in series)
        assert prom.query('up{job="rtop"}')[0]["value"][1] == "1"
        # rtop's own cost, labelled with the job too
        assert [r["metric"]["job"] for r in prom.query("rtop_hub_snapshot_build_seconds")
                ] == [job_id]

        # a counter: typed and named as one, and it grows between scrapes
        meta = prom.api("metadata", metric="rtop_steps_total") or {}
        assert [m["type"] for m in meta.get("rtop_steps_total", [])] == ["counter"], meta

        def steps0() -> float:
            got = prom.query('rtop_steps_total{rank="0"}')
            return float(got[0]["value"][1]) if got else -1.0

        first = steps0()
        assert first > 0
        assert wait_for(lambda: steps0() > first, 30)
        assert wait_for(lambda: bool(prom.query(
            'increase(rtop_steps_total{rank="1"}[10s]) > 0')), 30)

        # the wrong token: the target is down, refused with 401
        assert wait_for(lambda: [r["value"][1] for r in prom.query('up{job="wrong"}')]
                        == ["0"], 30)
        targets = (prom.api("targets") or {}).get("activeTargets", [])
        wrong = [t for t in targets if t["labels"].get("job") == "wrong"]
        assert wrong and wrong[0]["health"] == "down" and "401" in wrong[0]["lastError"]

        # the master token never scrapes: 403
        req = urllib.request.Request(f"http://{hub.address}/metrics",
                                     headers={"Authorization": f"Bearer {MASTER}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=5)
        assert refused.value.code == 403
    finally:
        if prom is not None:
            prom.close()
        stop.set()
        job.join(60)
        hub.stop()
