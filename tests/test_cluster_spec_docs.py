"""The cluster spec reference (docs/cluster-spec.md) is generated from the spec's models, documents
every field with an example, and its whole example is a cluster `polyparallel cluster check` accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from polyparallel.cli import main
from polyparallel.cluster import Cluster, spec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import cluster_spec  # noqa: E402 - docs/ is not a package

MODELS = [spec._ClusterSpec, spec._CenterSpec, spec._NodeGroupSpec, spec._LinkSpec, spec._ResidencySpec,
          spec._WanSpec, spec._DeviceTypeSpec]


def test_the_page_is_current() -> None:
    assert (ROOT / "docs" / "cluster-spec.md").read_text() == cluster_spec.page(), \
        "docs/cluster-spec.md is stale: run .venv/bin/python docs/cluster_spec.py"


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_has_a_meaning_and_an_example_that_validates(model) -> None:
    for name, f in model.model_fields.items():
        assert f.description and f.examples, f"{model.__name__}.{name} has no description or example"
    # each section's examples, put together, are a valid instance of it (required fields included)
    required = {n: f.examples[0] for n, f in model.model_fields.items()}
    if model is spec._LinkSpec:
        required.pop("up"), required.pop("down")  # 'bandwidth' or both directions, not all three
    model.model_validate(required)


def test_the_whole_example_loads_and_cluster_check_accepts_it(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    cl = Cluster.from_dict(cluster_spec.example())
    assert [c.name for c in cl.centers] == ["beijing", "wuhan"] and cl.num_devices == 2 * 8 + 4
    path = tmp_path / "two.yaml"
    path.write_text(cluster_spec.EXAMPLE)
    with pytest.raises(SystemExit) as e:
        main(["cluster", "check", str(path)])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert out.startswith("ok: two-centers: 2 center(s), 3 node(s), 20 device(s) (16 x a100-80gb-sxm, 4 x my-gpu)")


def test_cluster_check_names_the_first_bad_field_on_the_first_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = cluster_spec.example()
    bad["centers"][0]["nodes"][0]["intra"]["bandwidth"] = "-5 GB/s"
    bad["centers"][1]["nodes"][0]["colour"] = "red"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(SystemExit) as e:
        main(["cluster", "check", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err[0].startswith("error:") and "invalid cluster spec: centers.0.nodes.0.intra.bandwidth" in err[0]
    assert err[1].strip() == "centers.1.nodes.0.colour: unknown field: remove it or check its spelling"
