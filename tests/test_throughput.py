"""Throughput and MFU where they can be known: samples/s and tokens/s
(``probe.step(tokens=...)``, a callback's ``input_ids``), model TFLOPS and MFU from FLOPs
per step counted once by torch's FLOP counter (``probe.count_flops``) or given, against
the GPU's dense peak for its precision (``rtop.analysis.peaks``; "n/a" otherwise): in the
step records, the overview, the UI's header, the rank detail, ``rtop report`` and
Prometheus."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import collectors
from collectors import wire
from collectors.callbacks import tokens_in
from collectors.flops import count_step
from collectors.identity import detect
from collectors.schema import STEP_FIELDS
from collectors.steps import ClockMap, StepContext, step_row
from rtop.analysis import Monitor
from rtop.analysis.peaks import PEAK_TFLOPS, gpu_model, peak_flops
from rtop.hub.metrics import prometheus_text
from rtop.hub.service import ThreadedHub
from rtop.report import build_report, format_text
from rtop.run.state import RunState
from rtop.tui.detail import throughput_line
from rtop.tui.header import throughput_text
from tests.rankclient import identity
from tests.rankclient import step_row as make_row

F = {f: i for i, f in enumerate(STEP_FIELDS)}


@pytest.mark.parametrize(("name", "model"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA A10", "A10"), ("Tesla V100-SXM2-32GB", "V100 SXM2"),
    ("Tesla V100-PCIE-16GB", "V100 PCIe"), ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
    ("NVIDIA B200", "B200"), ("AMD Instinct MI300X", "MI300X"),
    ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 4090", None), ("", None), (None, None)])
def test_gpus_are_found_by_their_nvml_name(name: str | None, model: str | None):
    assert gpu_model(name) == model


def test_peaks_are_dense_and_na_where_not_known():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12  # 1,979 with sparsity
    assert peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # Volta has no bf16
    assert peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None
    assert peak_flops("NVIDIA H100 80GB HBM3", None) is None
    # tensor cores: fp16 and bf16 alike, twice tf32, fp8 twice again, where listed
    for model, peaks in PEAK_TFLOPS.items():
        if "bf16" in peaks:
            assert peaks["bf16"] == peaks["fp16"], model
        if "tf32" in peaks:
            assert peaks["fp16"] == pytest.approx(2 * peaks["tf32"], rel=0.02), model
        if "fp8" in peaks:
            assert peaks["fp8"] == pytest.approx(2 * peaks["fp16"], rel=0.02), model


class Block(torch.nn.Module):
    """Two linear layers and a batch norm (whose running statistics must not move)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = (torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128),
                                     torch.nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def test_count_flops_counts_a_training_step_once_and_changes_nothing():
    model = Block()
    model.norm.eval()  # a submodule the job froze: its mode stays its own
    before = model.norm.running_mean.clone(), model.norm.num_batches_tracked.clone()
    x = torch.randn(32, 64)
    counted = count_step(model, (x,), {})
    forward = 2 * 32 * (64 * 128 + 128 * 10)  # torch's counter: the two matmuls
    assert counted.forward == forward and counted.per_step == 3 * forward
    assert counted.dtype is None and counted.seconds > 0  # fp32 parameters: not said
    assert model.training and not model.norm.training and model.a.training
    assert torch.equal(model.norm.running_mean, before[0])
    assert torch.equal(model.norm.num_batches_tracked, before[1])
    assert model.a.weight.grad is None  # no backward ran
    assert count_step(model.to(torch.bfloat16), (x.bfloat16(),), {}).dtype == "bf16"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert count_step(Block(), (x,), {}).dtype == "bf16"
    assert count_step(Block(), (x,), {}, dtype="tf32").dtype == "tf32"


def test_the_probe_sends_tokens_and_flops_and_costs_nothing_when_not_told():
    probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=None), start_sender=False)
    try:
        model = Block()
        assert probe.count_flops(model, torch.randn(8, 64)) == 3 * 2 * 8 * (64 * 128 + 128 * 10)
        assert probe.figures["flops"]["source"] == "counted"
        for tokens, flops in ((None, None), (4096, None), (None, 1e9), (2048, 5e8)):
            with probe.step(tokens=tokens, flops=flops):
                pass
        raws = list(probe.records)
        assert [r[10] for r in raws] == [None, (4096, None), (None, 1e9), (2048, 5e8)]
        rows = [step_row(r, None, ClockMap(), world=1, nbytes=0,
                         context=StepContext(probe.flops_per_step)) for r in raws]
        counted = probe.flops_per_step
        assert [(r[F["tokens"]], r[F["flops"]]) for r in rows] == [
            (None, counted), (4096, counted), (None, 1e9), (2048, 5e8)]
        # a model that cannot run on the batch: a note, None, the job goes on
        assert probe.count_flops(model, torch.randn(8, 3)) is None
        assert any("count_flops could not" in n for n in probe.notes)
    finally:
        probe.close(0.1)
    null = collectors.NullProbe()
    with null.step(tokens=1, flops=2.0):
        pass
    assert null.count_flops(model) is None


def test_the_flops_setting_is_every_steps_default(monkeypatch):
    monkeypatch.setenv("RTOP_FLOPS_PER_STEP", "2.5e12")
    monkeypatch.setenv("RTOP_FLOPS_DTYPE", "fp8")
    cfg = collectors.ProbeConfig.from_env(hub=None)
    assert cfg.flops_per_step == 2.5e12 and cfg.flops_dtype == "fp8"
    probe = collectors.Probe(detect(), cfg, start_sender=False)
    assert probe.flops_per_step == 2.5e12
    assert probe.figures["flops"] == {"per_step": 2.5e12, "dtype": "fp8", "source": "setting"}
    probe.close(0.1)
    monkeypatch.setenv("RTOP_FLOPS_PER_STEP", "-3")
    monkeypatch.setenv("RTOP_FLOPS_DTYPE", "fp4")
    cfg = collectors.ProbeConfig.from_env(hub=None)
    assert cfg.flops_per_step is None and cfg.flops_dtype is None


def test_a_callback_counts_the_tokens_of_input_ids():
    assert tokens_in({"input_ids": torch.zeros(4, 128), "labels": torch.zeros(4)}) == 512
    assert tokens_in({"x": torch.zeros(4, 128)}) is None
    assert tokens_in((torch.zeros(4, 128),)) is None and tokens_in(torch.zeros(3)) is None


def fed(ranks: int, gpu: str | None, flops: float | None, tokens: int | None,
        dtype: str | None = None, groups: bool = False, steps: int = 60) -> Monitor:
    """A run of ``ranks`` ranks, each step 0.5 s, 32 samples, with these figures."""
    mon = Monitor(RunState(window_steps=200), None)
    t0 = 1_800_000_000.0
    for r in range(ranks):
        mon.apply(wire.Frame("hello", {"identity": identity(r, world=ranks)}), t0)
    for r in range(ranks):
        meta: dict[str, Any] = {"device": {"name": gpu}} if gpu else {}
        if dtype:
            meta["flops"] = {"per_step": flops, "dtype": dtype, "source": "setting"}
        if groups:  # two pipeline stages
            meta["groups"] = [{"name": f"pp{r % (ranks // 2)}", "desc": "mesh_pp",
                               "size": 2, "rank": r // (ranks // 2)}]
        rows = []
        for k in range(steps):
            row = make_row(k, step_s=0.5)
            row[F["t_wall"]] = t0 + 0.5 * k
            row[F["tokens"]], row[F["flops"]] = tokens, flops
            rows.append(row)
        mon.apply(wire.Frame("batch", {"rank": r, "group": "g0", "steps": rows,
                                       "meta": meta}), t0 + 1)
    mon.advance(t0 + 2.0, force=True)  # before the hub would call them lost
    return mon


def test_the_overview_has_the_jobs_throughput_and_mfu():
    mon = fed(4, "NVIDIA H100 80GB HBM3", flops=2e14, tokens=4096)
    t = mon.overview["throughput"]
    assert t["samples_per_s"] == pytest.approx(4 * 32 / 0.5)
    assert t["tokens_per_s"] == pytest.approx(4 * 4096 / 0.5)
    assert t["model_flops_per_s"] == pytest.approx(4 * 2e14 / 0.5)
    assert t["mfu"] == pytest.approx(4e14 / 989.5e12)  # each rank: 400 of 989.5 TFLOPS
    assert t["dtype"] == "bf16" and t["dtype_assumed"] and t["gpu"] == "H100 SXM"
    assert t["why_no_mfu"] is None and t["ranks_counted"] == 4
    # the precision a rank said is the one the peak is read for
    t = fed(2, "NVIDIA A100-SXM4-80GB", flops=2e13, tokens=None, dtype="tf32"
            ).overview["throughput"]
    assert t["mfu"] == pytest.approx(4e13 / 156e12) and not t["dtype_assumed"]
    assert t["tokens_per_s"] is None
    # what cannot be known is None, and says why
    t = fed(2, "NVIDIA GeForce RTX 4090", flops=1e12, tokens=None).overview["throughput"]
    assert t["mfu"] is None and t["model_flops_per_s"] == pytest.approx(4e12)
    assert "not in rtop's table" in t["why_no_mfu"]
    t = fed(2, None, flops=None, tokens=None).overview["throughput"]
    assert t["mfu"] is None and t["model_flops_per_s"] is None
    assert t["why_no_mfu"].startswith("no FLOPs per step known")
    # two pipeline stages: one replica's batch crosses both, so stage 0's samples count
    t = fed(4, "NVIDIA H100 80GB HBM3", flops=1e14, tokens=1024, groups=True
            ).overview["throughput"]
    assert t["ranks_counted"] == 2 and t["samples_per_s"] == pytest.approx(2 * 32 / 0.5)
    assert t["model_flops_per_s"] == pytest.approx(4 * 1e14 / 0.5)  # each its own part


def render(text: Any) -> str:
    console = Console(width=200, no_color=True)
    with console.capture() as cap:
        console.print(text)
    return cap.get()


def test_header_detail_prometheus_and_report_show_it(tmp_path):
    mon = fed(4, "NVIDIA H100 80GB HBM3", flops=2e14, tokens=4096)
    snap = mon.snapshot()
    header = render(throughput_text(snap["overview"]["throughput"]))
    assert "32.8k tokens/s" in header and "1,600 TFLOPS" in header
    assert "MFU 40% of bf16 peak (assumed)" in header
    line = render(throughput_line(mon.rank_detail(1)))
    assert "64.0 samples/s" in line and "8,192 tokens/s" in line
    assert "400 TFLOPS (model)" in line and "MFU 40.4% of the bf16 peak" in line
    assert render(throughput_line(fed(1, None, None, None).rank_detail(0))).startswith(
        "Throughput 64.0 samples/s")
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(snap))}
    assert families["rtop_job_tokens_per_second"].samples[0].value == pytest.approx(32768)
    assert families["rtop_job_mfu_ratio"].samples[0].value == pytest.approx(4e14 / 989.5e12)
    assert {s.labels["rank"]: s.value for s in families["rtop_step_tokens"].samples} == {
        str(r): 4096 for r in range(4)}
    assert "rtop_job_mfu_ratio" not in prometheus_text(
        fed(2, None, None, None).snapshot())  # not known: no series, never 0


def test_a_real_rank_counts_its_flops_and_says_its_tokens(tmp_path):
    """A real probe, a real hub, its recording read back by ``rtop report``: tokens and
    counted FLOPs per step; no GPU here, so MFU says why it is n/a."""
    hub = ThreadedHub(job="tokens", record=str(tmp_path / "run.rtop")).start()
    try:
        probe = collectors.Probe(detect(), collectors.ProbeConfig(hub=hub.address,
                                                                  token=hub.token))
        model = Block()
        batches = [torch.randn(16, 64) for _ in range(30)]
        flops = probe.count_flops(model, batches[0])
        for k, x in enumerate(probe.iter(batches)):
            with probe.step(tokens=16 * 256 + k % 2):
                model(x).sum().backward()
            time.sleep(0.01)
        probe.close()
    finally:
        hub.stop()
    report = build_report(tmp_path / "run.rtop", find_spools=False)
    [rank] = report["ranks"]
    assert rank["steps"] == 30 and rank["samples_per_step"] == 16
    assert rank["tokens_per_step"] == pytest.approx(16 * 256 + 0.5)
    assert rank["flops_per_step"] == flops == 3 * 2 * 16 * (64 * 128 + 128 * 10)
    assert rank["model_flops_per_s"] == pytest.approx(flops / rank["step_s"])
    assert rank["mfu"] is None
    t = report["throughput"]
    assert t["tokens_per_s"] == pytest.approx(rank["tokens_per_s"])
    assert t["why_no_mfu"] == "no GPU measured"
    text = format_text(report)
    assert "throughput over the run:" in text and "MFU n/a (no GPU measured)" in text
