"""deployment.yaml -> DeploymentSpec: the example file, and each kind of bad input refused naming its field."""

import json

import pytest

from optimized.fleet.deployment import ROLES, DeploymentError, DeploymentSpec, load_deployment, parse_deployment

EXAMPLE = "examples/fleet/deployment.yaml"


def _doc(**over):
    doc = {"version": 1, "name": "t", "model": {"family": "wan", "variant": "tiny-2.1-t2v"},
           "transport": "inprocess", "placement": {"backend": "local"},
           "roles": {"encoder": {"replicas": 1}, "denoiser": {"replicas": 2}, "decoder": {}}}
    doc.update(over)
    return doc


def test_example_file_is_one_encoder_two_denoisers_one_decoder():
    pytest.importorskip("yaml")
    spec = load_deployment(EXAMPLE)
    assert isinstance(spec, DeploymentSpec)
    assert [p.role for p in spec.roles] == list(ROLES)
    assert [spec.pool(r).replicas for r in ROLES] == [1, 2, 1]
    assert spec.replica_ids("denoiser") == ["denoiser-0", "denoiser-1"]
    assert spec.placement.backend == "ray" and spec.placement.address == "local"
    assert spec.model.family == "wan" and spec.model.variant == "tiny-2.1-t2v"


def test_defaults_and_round_trip():
    spec = parse_deployment(_doc())
    assert spec.pool("decoder").replicas == 1 and spec.pool("decoder").ranks == 1
    assert spec.routing.max_attempts == 3 and spec.routing.affinity is True
    again = parse_deployment(spec.to_dict())
    assert again == spec


def test_json_file_reads(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(_doc()))
    assert load_deployment(p).pool("denoiser").replicas == 2


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["roles"]["denoiser"].update(replicas=0), "roles.denoiser.replicas"),
    (lambda d: d["roles"]["denoiser"].update(replicas="two"), "roles.denoiser.replicas"),
    (lambda d: d["roles"]["denoiser"].update(replicas=True), "roles.denoiser.replicas"),
    (lambda d: d["roles"].pop("decoder"), "roles.decoder"),
    (lambda d: d["roles"].update(vae={}), "roles.vae"),
    (lambda d: d["roles"]["encoder"].update(gpus=1), "roles.encoder.gpus"),
    (lambda d: d["roles"]["denoiser"].update(ranks=2), "roles.denoiser.ranks"),
    (lambda d: d["roles"]["encoder"].update(num_cpus=-1), "roles.encoder.num_cpus"),
    (lambda d: d.update(transport="carrier-pigeon"), "transport"),
    (lambda d: d.update(transport="ray_object_store"), "transport"),   # placement.backend is local
    (lambda d: d["placement"].update(strategy="pack-ish"), "placement.strategy"),
    (lambda d: d["placement"].update(backend="k8s"), "placement.backend"),
    (lambda d: d.update(model={"family": "wan"}), "model"),
    (lambda d: d.update(model={"variant": "tiny-2.1-t2v"}), "model.family"),
    (lambda d: d["model"].update(path="x"), "model"),
    (lambda d: d["model"].update(device="tpu"), "model.device"),
    (lambda d: d["model"].update(dtype="fp8"), "model.dtype"),
    (lambda d: d.update(routing={"max_attempts": 0}), "routing.max_attempts"),
    (lambda d: d.update(routing={"health_interval_s": 0}), "routing.health_interval_s"),
    (lambda d: d.update(routing={"affinity": "yes"}), "routing.affinity"),
    (lambda d: d.update(slo={"max_queue": 0}), "slo.max_queue"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(replicas=3), "replicas"),
    (lambda d: d.update(roles=[1, 2]), "roles"),
])
def test_bad_field_is_named(mutate, field):
    doc = json.loads(json.dumps(_doc()))
    mutate(doc)
    with pytest.raises(DeploymentError) as e:
        parse_deployment(doc)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}:")


def test_bad_files(tmp_path):
    with pytest.raises(DeploymentError, match="no such file"):
        load_deployment(tmp_path / "nope.yaml")
    pytest.importorskip("yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("roles: {encoder: [1, 2\n")
    with pytest.raises(DeploymentError, match="not valid YAML at line"):
        load_deployment(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(DeploymentError, match="must be a mapping"):
        load_deployment(scalar)


def test_fleet_card_has_the_seed_fields():
    from optimized.fleet.card import fleet_card
    spec = parse_deployment(_doc())
    card = fleet_card(spec).to_dict()
    for name in ("engine_id", "model_specs", "role_pools", "supported_programs", "supported_parallel_plans",
                 "cache_events", "transfer_endpoints", "cost_model", "health_schema", "slo_schema"):
        assert name in card, name
    assert [(p["role"], list(p["replicas"])) for p in card["role_pools"]] == [
        ("encoder", ["encoder-0"]), ("denoiser", ["denoiser-0", "denoiser-1"]), ("decoder", ["decoder-0"])]
    assert [(e["producer"], e["consumer"], e["transport"]) for e in card["transfer_endpoints"]] == [
        ("encoder", "denoiser", "inprocess"), ("denoiser", "decoder", "inprocess")]
    assert card["model_specs"] == ["wan:tiny-2.1-t2v"] and card["supported_programs"] == ["video"]
    assert card["slo_schema"]["max_queue"] == 16 and card["health_schema"]["probe_interval_s"] == 2.0
    assert set(card["cost_model"]["seconds_per_unit"]) == {"encoder", "denoiser", "decoder"}
    # the id changes with the deployment (an orchestrator tells two fleets apart)
    other = fleet_card(parse_deployment(_doc(roles={"encoder": {}, "denoiser": {"replicas": 3}, "decoder": {}})))
    assert other.engine_id != card["engine_id"]


def test_fleet_card_reads_the_live_router():
    from optimized.fleet.card import fleet_card
    from optimized.fleet.router import HealthReport, Router, StageCostModel

    class Idle:
        def __init__(self, role, i):
            self.role, self.replica_id = role, f"{role}-{i}"

        def health(self, timeout_s):
            return HealthReport(self.replica_id, self.role, True)
    spec = parse_deployment(_doc())
    router = Router({r: [Idle(r, i) for i in range(spec.pool(r).replicas)] for r in ROLES}, spec.routing,
                    StageCostModel())
    router.cost.observe("denoiser", 10, 0.5)
    router.mark_dead("denoiser-0", "killed")
    card = fleet_card(spec, router).to_dict()
    assert card["cost_model"]["seconds_per_unit"]["denoiser"]["miss"] == 0.05
    assert card["health"]["status"] == "ok"                   # denoiser-1 still serves
    assert [r["status"] for r in card["health"]["roles"]["denoiser"]] == ["dead", "healthy"]


def test_serve_fleet_cli_bad_deployment_exits_2_with_one_message(tmp_path, capsys):
    pytest.importorskip("fastapi")
    from optimized.serving.fleet_server import main
    bad = tmp_path / "d.json"
    bad.write_text(json.dumps(_doc(roles={"encoder": {}, "denoiser": {"replicas": 0}, "decoder": {}})))
    assert main(["--fleet", str(bad), "--output-dir", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --fleet {bad}: roles.denoiser.replicas: must be an integer >= 1, got 0"
    assert main(["--fleet", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    unknown = tmp_path / "u.json"
    unknown.write_text(json.dumps(_doc(model={"family": "wan", "variant": "tiny-9"})))
    assert main(["--fleet", str(unknown), "--port", "0", "--output-dir", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: wan has no variant 'tiny-9'") and "\n" not in err


def test_fvgen_serve_fleet_is_the_fleet_server(tmp_path, capsys):
    """`fvgen serve --fleet FILE` goes to the fleet server (its usage line and its field-naming errors), and plain
    `fvgen serve FAMILY` still to the co-located one."""
    pytest.importorskip("fastapi")
    from optimized.serving.fvgen import main
    bad = tmp_path / "d.json"
    bad.write_text(json.dumps(_doc(roles={"encoder": {}, "denoiser": {"replicas": 0}, "decoder": {}})))
    assert main(["serve", "--fleet", str(bad), "--output-dir", str(tmp_path / "v")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --fleet {bad}: roles.denoiser.replicas: must be an integer "
                                               ">= 1, got 0")
    assert main(["serve", f"--fleet={tmp_path / 'missing.yaml'}"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["serve", "--fleet", str(bad), "--help"]) == 0
    assert "usage: fvgen serve --fleet" in capsys.readouterr().out
    assert main(["serve", "--help"]) == 0
    assert "--fleet" not in capsys.readouterr().out.split("options:")[0]
