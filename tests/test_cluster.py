"""Cluster spec: presets, link queries, unit parsing, validation errors, CLI."""

from __future__ import annotations

import json
import math

import pytest

from polyparallel.cluster import Cluster, ClusterSpecError, parse_quantity


def _spec(**center_overrides):
    center = {"name": "a", "framework": "torch",
              "nodes": [{"device": "a100-80gb-sxm", "devices_per_node": 2,
                         "intra": {"bandwidth": "100 GB/s", "latency": "2 us"}}]}
    center.update(center_overrides)
    return {"name": "t", "centers": [center]}


@pytest.mark.parametrize(("text", "kind", "value"), [
    ("200 Gb/s", "bandwidth", 25e9), ("25 GB/s", "bandwidth", 25e9), ("8Mbps", "bandwidth", 1e6),
    ("1 GiB/s", "bandwidth", 2**30), ("5 us", "time", 5e-6), ("20ms", "time", 0.02), ("1.5 µs", "time", 1.5e-6),
    ("80 GB", "bytes", 80e9), ("32 GiB", "bytes", 32 * 2**30), ("312 TFLOP/s", "flops", 312e12),
    ("19.5 TFLOPS", "flops", 19.5e12), (3.0, "time", 3.0),
])
def test_parse_quantity(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value)


@pytest.mark.parametrize(("text", "kind"), [("fast", "bandwidth"), ("10 parsecs", "time"), ("5 GB", "bandwidth")])
def test_parse_quantity_rejects(text, kind):
    with pytest.raises(ValueError, match="cannot read"):
        parse_quantity(text, kind)


def test_dgx_presets():
    c = Cluster.preset("dgx-a100x4")
    assert (c.num_devices, len(c.nodes), len(c.centers)) == (32, 4, 1)
    assert c.level(0, 7) == "intra_node" and c.level(7, 8) == "inter_node"
    a100 = c.device(0).type
    assert a100.peak_flops("bf16") == 312e12 and a100.memory == 80e9 and a100.memory_bandwidth == 2039e9
    # NVSwitch: 300 GB/s per direction at 80% efficiency; IB: one 200 Gb/s rail per GPU at 90%
    assert c.link(0, 1) == (pytest.approx(240e9), pytest.approx(3e-6))
    assert c.link(0, 8) == (pytest.approx(25e9 * 0.9), pytest.approx(5e-6))
    assert c.node_bandwidth(0) == pytest.approx(8 * 25e9 * 0.9)
    h = Cluster.preset("dgx-h100x2")
    assert h.device(0).type.peak_flops("bfloat16") == 989.5e12 and h.num_devices == 16
    h2 = Cluster.preset("dgx-h200")
    assert h2.device(0).type.memory == 141e9 and h2.num_devices == 8


def test_aisynergy_preset():
    c = Cluster.preset("aisynergy-5")
    assert len(c.centers) == 5 and len({ct.city for ct in c.centers}) == 5
    assert {d.type.name for d in c.devices} == {"a100-80gb-sxm", "v100-sxm2-32gb", "ascend-910"}
    assert {ct.framework for ct in c.centers} == {"torch", "mindspore"}
    assert all(not ct.data_may_leave for ct in c.centers)
    firsts = [c.devices_of(center=i)[0] for i in range(5)]
    for a in firsts:
        for b in firsts:
            if a == b:
                continue
            bw, lat = c.link(a, b)
            assert c.level(a, b) == "inter_center"
            assert 1e9 / 8 <= bw <= 10e9 / 8 and 10e-3 <= lat <= 40e-3
    # Ascend publishes no fp32 or bf16 figure: both priced at the fp16 rate
    ascend = c.device(c.devices_of(center=2)[0]).type
    assert ascend.peak_flops("fp32") == ascend.peak_flops("bf16") == 256e12


def test_asymmetric_wan_and_shared_backbone():
    c = Cluster.preset("aisynergy-5")
    chengdu, beijing = c.devices_of(center=4)[0], c.devices_of(center=0)[0]
    assert c.link(chengdu, beijing)[0] == pytest.approx(1e9 / 8)  # chengdu uplink 1 Gb/s
    assert c.link(beijing, chengdu)[0] == pytest.approx(2e9 / 8)  # chengdu downlink 2 Gb/s
    assert c.center_latency(0, 4) == pytest.approx(35e-3)  # declared pair latency
    assert c.center_latency(0, 3) == pytest.approx(22e-3)  # sum of the two legs
    raw = {"name": "w", "wan": {"backbone": {"bandwidth": "10 Gb/s", "oversubscription": 2}},
           "centers": [{"name": n, "nodes": [{"device": "v100-sxm2-32gb", "devices_per_node": 1}],
                        "wan": {"bandwidth": "10 Gb/s", "latency": "5 ms"}} for n in ("x", "y", "z")]}
    w = Cluster.from_dict(raw)
    assert w.link(0, 1)[0] == pytest.approx(10e9 / 8 / 2)
    assert w.center_bandwidth(0, flows=3) == pytest.approx(10e9 / 8 / 2 / 3)


def test_local_cpu_uses_calibration(tmp_path, monkeypatch):
    cal = {"cores": 2, "memory_bandwidth": 8e9, "launch_overhead": 4e-6, "memory_bytes": 16e9,
           "matmul": {"1": [{"n": 64, "flops": 2 * 64**3, "seconds": 2 * 64**3 / 20e9},
                            {"n": 256, "flops": 2 * 256**3, "seconds": 2 * 256**3 / 50e9}]},
           "collectives": {"fit": {"alpha": 100e-6, "bandwidth": 2e9}}}
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(p))
    c = Cluster.preset("local-cpu:4")
    dt = c.device(0).type
    # 4 processes time-share 2 cores: every rate halves
    assert dt.peak_flops("fp32") == pytest.approx(25e9)
    assert c.link(0, 3) == (pytest.approx(2e9), pytest.approx(100e-6))
    assert str(p) in dt.source
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(tmp_path / "missing.json"))
    assert "nominal" in Cluster.preset("local-cpu:2").device(0).type.source


def test_load_yaml_and_json(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("name: mine\ncenters:\n  - name: lab\n    nodes:\n      - device: h100-sxm\n"
                 "        devices_per_node: 4\n        intra: {kind: nvlink, bandwidth: 450 GB/s, latency: 2 us}\n")
    c = Cluster.load(y)
    assert c.num_devices == 4 and c.link(0, 3)[0] == 450e9
    j = tmp_path / "c.json"
    j.write_text(json.dumps(_spec()))
    assert Cluster.load(j).num_devices == 2
    assert Cluster.resolve(str(j)).num_devices == 2


def test_custom_device_type():
    raw = _spec(nodes=[{"device": "mychip", "devices_per_node": 1}])
    raw["device_types"] = {"mychip": {"kind": "npu", "peak": {"fp16": "100 TFLOP/s"}, "memory": "16 GB",
                                      "memory_bandwidth": "800 GB/s", "source": "test"}}
    c = Cluster.from_dict(raw)
    assert c.device(0).type.peak_flops("fp16") == 100e12


@pytest.mark.parametrize(("mutate", "where", "what"), [
    (lambda r: r["centers"][0]["nodes"][0].update(device="tpu-v9"), "centers.0.nodes.0.device",
     "unknown device type 'tpu-v9'"),
    (lambda r: r["centers"][0]["nodes"][0]["intra"].update(bandwidth=0), "centers.0.nodes.0.intra.bandwidth",
     "must be > 0"),
    (lambda r: r["centers"][0]["nodes"][0]["intra"].update(bandwidth="-5 GB/s"), "centers.0.nodes.0.intra.bandwidth",
     "cannot read"),
    (lambda r: r["centers"][0].update(nodes=[]), "centers.0", "has no devices"),
    (lambda r: r["centers"][0].update(framework="jax"), "centers.0.framework", "unsupported framework 'jax'"),
    (lambda r: r["centers"][0]["nodes"][0].update(devices_per_node=0), "devices_per_node", "greater than or equal"),
    (lambda r: r["centers"][0]["nodes"][0].update(speed=3), "centers.0.nodes.0.speed", "unknown field"),
    (lambda r: r.pop("name"), "name", "required field is missing"),
    (lambda r: r.update(centers=[]), "centers", "at least one center"),
    (lambda r: r["centers"][0]["nodes"][0].update(count=2), "centers.0.nodes.0.nic", "need network ports"),
])
def test_validation_errors_name_field_and_fix(tmp_path, mutate, where, what):
    raw = _spec()
    mutate(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ClusterSpecError) as e:
        Cluster.load(path)
    msg = str(e.value)
    assert str(path) in msg and where in msg and what in msg


def test_multi_center_needs_wan_and_bad_yaml(tmp_path):
    raw = {"name": "m", "centers": [_spec()["centers"][0], {**_spec()["centers"][0], "name": "b"}]}
    with pytest.raises(ClusterSpecError, match=r"centers\.0\.wan"):
        Cluster.from_dict(raw)
    p = tmp_path / "x.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(ClusterSpecError, match="not valid YAML"):
        Cluster.load(p)
    with pytest.raises(ClusterSpecError, match="unknown cluster preset"):
        Cluster.preset("dgx-b200x2")
    with pytest.raises(ClusterSpecError, match="no such cluster spec"):
        Cluster.resolve(tmp_path / "none.yaml")


def test_cli_cluster_show(capsys):
    from polyparallel.cli import main

    with pytest.raises(SystemExit) as e:
        main(["cluster", "show", "dgx-a100x2"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "16 device(s)" in out and "a100-80gb-sxm" in out
    with pytest.raises(SystemExit) as e:
        main(["cluster", "show", "dgx-a100x2", "--json"])
    assert json.loads(capsys.readouterr().out)["totals"]["devices"] == 16
    with pytest.raises(SystemExit) as e:
        main(["cluster", "show", "nowhere-9"])
    assert e.value.code == 2
    assert "unknown cluster preset 'nowhere-9'" in capsys.readouterr().err


def test_cli_calibrate_rejects_bad_input(capsys, tmp_path):
    from polyparallel.cli import main

    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--group-sizes", "1,x", "--out", str(tmp_path / "c.json")])
    assert e.value.code == 2 and "--group-sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--out", str(tmp_path)])
    assert e.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_totals_sum_devices():
    c = Cluster.preset("aisynergy-5")
    t = c.totals
    assert t["devices"] == sum(t["devices_by_type"].values()) == 88
    assert t["memory_bytes"] == pytest.approx(24 * 80e9 + 16 * 32e9 + 48 * 32e9)
    assert math.isclose(t["peak_flops"]["bf16"], 24 * 312e12 + 16 * 15.7e12 + 48 * 256e12)


def test_local_cpu_picks_the_fit_of_its_process_count(tmp_path, monkeypatch):
    from polyparallel.cost_models.calibrate import fit_alpha_beta

    pts = [(p, n, 2 * (p - 1) * 1e-4 + 2 * (p - 1) / p * n / 3e9) for p in (2, 3, 4) for n in (1e3, 1e5, 1e7)]
    fit = fit_alpha_beta(pts)
    assert fit["alpha"] == pytest.approx(1e-4) and fit["bandwidth"] == pytest.approx(3e9)
    cal = {"cores": 4, "memory_bandwidth": 8e9, "matmul": {"1": [{"n": 64, "flops": 1e6, "seconds": 1e-4}]},
           "collectives": {"fit": {"alpha": 1e-4, "bandwidth": 1e9},
                           "fit_by_group_size": {"2": {"alpha": 2e-4, "bandwidth": 2e9},
                                                 "4": {"alpha": 4e-4, "bandwidth": 4e9}}}}
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(p))
    assert Cluster.preset("local-cpu:2").link(0, 1) == (2e9, 2e-4)
    assert Cluster.preset("local-cpu:4").link(0, 1) == (4e9, 4e-4)
    assert Cluster.preset("local-cpu:3").link(0, 1) == (4e9, 4e-4)  # nearest, the larger on a tie


def test_local_cpu_prefers_rates_measured_with_p_processes(tmp_path, monkeypatch):
    one = [{"n": 256, "flops": 2 * 256**3, "seconds": 2 * 256**3 / 100e9}]
    four = [{"n": 256, "flops": 2 * 256**3, "seconds": 2 * 256**3 / 30e9}]
    cal = {"cores": 2, "memory_bandwidth": 10e9, "matmul": {"1": one},
           "per_processes": {"4": {"matmul": four, "memory_bandwidth": 3e9, "launch_overhead": 1e-5}}}
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal))
    monkeypatch.setenv("POLYPARALLEL_CALIBRATION", str(p))
    four_procs = Cluster.preset("local-cpu:4").device(0).type
    assert four_procs.peak_flops() == pytest.approx(30e9) and four_procs.memory_bandwidth == 3e9
    # no measurement with 3 processes: single-process rates scaled by the core share 2/3
    assert Cluster.preset("local-cpu:3").device(0).type.peak_flops() == pytest.approx(100e9 * 2 / 3)


def test_example_cluster_lays_the_h200_calibration_over_the_data_sheet():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cal = json.loads((root / "benchmarks/results/calibration_h200-sxm.json").read_text())
    dt = Cluster.load(root / "examples/clusters/dgx-h200-calibrated.yaml").device(0).type
    best = max(r["flops"] / r["seconds"] for r in cal["matmul"]["bf16"])
    assert max(f / s for f, s in dict(dt.matmul_curves)["bf16"]) == pytest.approx(best)
    assert dt.memory_efficiency == pytest.approx(cal["memory_bandwidth"] / 4800e9)
    assert dt.peak_flops("bf16") == 989.5e12  # the data sheet stays for what was not measured


def test_a_collaborative_plan_names_paddle_and_tensorflow_centers(tmp_path) -> None:
    """Every framework a cluster file may give a center is one a Strategy's center plan can name: the
    five-center preset with two centers switched to PaddlePaddle and TensorFlow searches to a plan
    that writes and reads back (the record allowed torch and mindspore only)."""
    import torch

    import polyparallel as pp
    from polyparallel.cluster.spec import preset_raw
    from polyparallel.models import MLP

    raw = preset_raw("aisynergy-5")
    raw["centers"][0]["framework"], raw["centers"][1]["framework"] = "paddle", "tensorflow"
    cl = Cluster.from_dict(raw, source="test")
    s = pp.search(MLP(), (torch.randn(8, 784),), cl, batch_size=64)
    frameworks = {c.name: c.framework for c in s.collaborative.centers}
    assert frameworks[raw["centers"][0]["name"]] == "paddle" and frameworks[raw["centers"][1]["name"]] == "tensorflow"
    s.to_json(tmp_path / "s.json")
    back = pp.Strategy.from_json(tmp_path / "s.json").collaborative
    assert {c.framework for c in back.centers} >= {"paddle", "tensorflow"}
