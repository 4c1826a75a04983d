"""Serving accelerations (issue 21 part 5): the `accel` request field (text NAME[:knobs], parsed by
manifests.accel.parse_accel; a bad value is a ServingError / HTTP 400 / fvgen exit 2 carrying the AccelSpecError
message), an engine default (`serve_accel(..., default=True)`, "none" asks for the exact path), the DeploymentCard
listing each served acceleration with its certificate, `fvgen --accel`, and trace.step showing what was skipped."""

from __future__ import annotations

import json

import pytest

from manifests.accel import AccelSpec
from optimized.serving.families import ServingError
from optimized.serving.requests import build_request, serve_accel

SPEC = "fbcache:threshold=0.5"


@pytest.fixture(scope="module")
def engine():
    from optimized.serving.loading import load_engine
    return load_engine("wan", None, "tiny-2.1-t2v")


@pytest.fixture
def fresh(engine):
    engine.__dict__.pop("served_accels", None)
    yield engine
    engine.__dict__.pop("served_accels", None)


def _req(engine, **kw):
    req, _ = build_request(engine, prompt_ids=[3, 4, 5], num_frames=5, height=32, width=32, num_steps=3, **kw)
    return req


def test_request_field_parses_and_refuses(fresh):
    req = _req(fresh, accel=SPEC)
    assert isinstance(req.accel, AccelSpec) and req.accel.label() == "fbcache:threshold=0.5"
    assert _req(fresh).accel is None
    with pytest.raises(ServingError, match=r"^accel: unknown acceleration 'nosuch'"):
        _req(fresh, accel="nosuch")
    with pytest.raises(ServingError, match=r"accel: accel fbcache: knob threshold must be in"):
        _req(fresh, accel="fbcache:threshold=-2")
    with pytest.raises(ServingError, match="must be a string"):
        _req(fresh, accel=3)


def test_engine_default_and_exact_override(fresh):
    serve_accel(fresh, SPEC, default=True)
    assert _req(fresh).accel.label() == "fbcache:threshold=0.5"
    assert _req(fresh, accel="none").accel is None
    assert _req(fresh, accel="dbcache:fn=1").accel.name == "dbcache"


def test_card_lists_served_accelerations_with_certificates(fresh, tmp_path):
    cert = tmp_path / "cert.json"
    cert.write_text(json.dumps({"label": "fbcache:threshold=0.5", "passed": False, "reasons": ["PSNR 20 dB < 30"],
                                "budget": {"min_psnr_db": 30.0}, "requests": {"placeholder": True}}))
    serve_accel(fresh, SPEC, certificate=cert, default=True)
    serve_accel(fresh, "sta")
    card = fresh.deployment_card()
    rows = {r["label"]: r for r in card["accelerations"]}
    fb = rows["fbcache:threshold=0.5"]
    assert fb["certificate"] == str(cert) and fb["passed"] is False and fb["budget"] == {"min_psnr_db": 30.0}
    assert fb["default"] is True and fb["placeholder"] is True and fb["reasons"] == ["PSNR 20 dB < 30"]
    assert rows[next(k for k in rows if k.startswith("sta"))]["certificate"] is None
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"label": "dbcache:fn=1", "passed": True}))
    with pytest.raises(ServingError, match="certifies 'dbcache:fn=1', not this acceleration"):
        serve_accel(fresh, SPEC, certificate=other)


def test_card_without_accelerations_is_empty(fresh):
    assert fresh.deployment_card()["accelerations"] == []


def test_trace_step_shows_what_was_skipped(fresh):
    events = []
    fresh.scheduler.bus.subscribe(events.append, "trace.step")
    req = _req(fresh, accel="dbcache:fn=1,bn=0,threshold=1,warmup=1")
    res = fresh.generate(req)
    rows = [r for e in events for r in e.data.get("accel", [])]
    assert rows, "trace.step carries the accelerated request's decisions"
    assert [r["action"] for r in rows] == [d.action for d in res["accel"]["decisions"]]
    assert "reuse" in {r["action"] for r in rows}          # some block range really was skipped
    assert any(r["blocks_reused"] for r in rows)


def test_http_field_400_names_the_field(fresh, tmp_path):
    from optimized.serving.videos_api import BadField, ImageLimits, parse_fields
    with pytest.raises(BadField) as e:
        parse_fields({"prompt_ids": [1, 2], "accel": "nosuch"}, None, ImageLimits(False))
    assert e.value.param == "accel" and e.value.status == 400 and "unknown acceleration 'nosuch'" in str(e.value)
    with pytest.raises(BadField):
        parse_fields({"prompt_ids": [1, 2], "accel": 5}, None, ImageLimits(False))
    assert parse_fields({"prompt_ids": [1, 2], "accel": SPEC}, None, ImageLimits(False))["accel"] == SPEC
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from optimized.serving.server import create_app
    with TestClient(create_app(fresh, output_dir=tmp_path / "videos")) as client:
        r = client.post("/v1/videos", json={"prompt_ids": [3, 4], "size": "32x32", "frames": 5, "steps": 2,
                                            "accel": "fbcache:threshold=x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "accel", r.text
        assert "knob threshold must be float" in r.json()["error"]["message"]


def test_fvgen_accel_flag(tmp_path, capsys):
    from optimized.serving.fvgen import main
    rc = main(["wan", "--variant", "tiny-2.1-t2v", "--prompt-ids", "3,4", "--frames", "5", "--size", "32x32",
               "--steps", "2", "--accel", "fbcache:nope=1", "--out", str(tmp_path / "o.mp4"), "--quiet"])
    assert rc == 2 and "accel: accel fbcache: unknown knob 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o.mp4").exists()
    rc = main(["wan", "--variant", "tiny-2.1-t2v", "--prompt-ids", "3,4", "--frames", "5", "--size", "32x32",
               "--steps", "2", "--accel", SPEC, "--out", str(tmp_path / "frames"), "--quiet"])
    assert rc == 0 and sorted((tmp_path / "frames").glob("*.png")), capsys.readouterr().err
