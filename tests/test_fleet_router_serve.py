"""The fleet behind the HTTP API, in this process (placement.backend local: every replica an in-process Engine):
/v1/videos answered by 1 encoder, 2 denoisers and 1 decoder is bitwise the co-located server's video; a denoiser
that dies mid-request is failed over, the video written once; with no denoiser left the video fails, one clear
error. (The same against a local Ray cluster: tests/test_fleet_ray_serve.py, slow.)"""

import dataclasses
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient

from optimized.fleet.deployment import parse_deployment
from optimized.fleet.router import ReplicaDied, StagePlan

BODY = {"prompt": "a red fox", "size": "32x32", "frames": 5, "steps": 3, "guidance": 4.0, "seed": 7}


def spec(denoisers=2):
    return parse_deployment({
        "name": "t", "model": {"family": "wan", "variant": "tiny-2.1-t2v"}, "transport": "inprocess",
        "placement": {"backend": "local"},
        "roles": {"encoder": {}, "denoiser": {"replicas": denoisers}, "decoder": {}},
        "routing": {"health_interval_s": 3600}})


def wait(client, vid, deadline=120.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline:
        obj = client.get(f"/v1/videos/{vid}").json()
        if obj["status"] in ("completed", "failed"):
            return obj
        time.sleep(0.05)
    raise AssertionError(f"{vid} still {obj['status']}")


def make(client, body=BODY):
    r = client.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    return wait(client, r.json()["id"])


def contents(client, vid):
    return {v: client.get(f"/v1/videos/{vid}/content", params={"variant": v}).content
            for v in ("video", "thumbnail")}


SEEDS = (21, 22, 23)


@pytest.fixture(scope="module")
def colocated_app(tmp_path_factory):
    from optimized.serving.loading import load_engine
    from optimized.serving.server import create_app
    app = create_app(load_engine("wan", None, "tiny-2.1-t2v"), output_dir=tmp_path_factory.mktemp("co"))
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def colocated(colocated_app):
    done = make(colocated_app)
    assert done["status"] == "completed", done
    return contents(colocated_app, done["id"])


class Killable:
    """A replica wrapper whose process 'dies' at its next stage call (raises ReplicaDied from then on)."""

    def __init__(self, replica):
        self.replica, self.replica_id, self.role = replica, replica.replica_id, replica.role
        self.dead, self.calls, self.delay_s = False, 0, 0.0

    def run_stage(self, call):
        self.calls += 1
        if self.dead:
            raise ReplicaDied(self.replica_id, "process exited (planted)")
        time.sleep(self.delay_s)                     # a slower stage: still running when the next one is placed
        return self.replica.run_stage(call)

    def health(self, timeout_s):
        if self.dead:
            raise ReplicaDied(self.replica_id, "process exited (planted)")
        return self.replica.health(timeout_s)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from optimized.serving.fleet_server import FleetGateway, create_fleet_app
    gw = FleetGateway.start(spec())
    gw.router.states["denoiser"] = {rid: type(st)(Killable(st.replica))
                                    for rid, st in gw.router.states["denoiser"].items()}
    app = create_fleet_app(gw, output_dir=tmp_path_factory.mktemp("fleet"))
    with TestClient(app) as client:
        yield client, gw


def test_fleet_video_is_bitwise_the_colocated_one(fleet, colocated):
    client, gw = fleet
    done = make(client)
    assert done["status"] == "completed", done
    assert contents(client, done["id"]) == colocated
    card = client.get("/v1/models").json()["data"][0]["deployment_card"]
    assert [p["replicas"] for p in card["extra"]["fleet"]["role_pools"]] == [["encoder-0"], ["denoiser-0",
                                                                                            "denoiser-1"],
                                                                             ["decoder-0"]]
    assert card["family"] == "wan"
    status = client.get("/v1/fleet").json()
    assert status["status"] == "ok" and status["roles"]["decoder"][0]["completed"] >= 1


def test_concurrent_requests_spread_over_the_denoisers_each_bitwise_the_colocated(fleet, colocated_app):
    from concurrent.futures import ThreadPoolExecutor
    client, gw = fleet
    want = {}
    for seed in SEEDS:   # one at a time on the co-located server: each runs solo, as on a replica
        done = make(colocated_app, {**BODY, "seed": seed})
        want[seed] = contents(colocated_app, done["id"])
    used, real = set(), gw.router.on_event

    def record(kind, rid, data):
        if kind == "stage.completed" and data["role"] == "denoiser":
            used.add(data["replica"])
        real(kind, rid, data)
    gw.router.on_event = record
    for st in gw.router.states["denoiser"].values():
        st.replica.delay_s = 1.0
    try:
        with ThreadPoolExecutor(3) as pool:
            got = dict(zip(SEEDS, pool.map(lambda seed: make(client, {**BODY, "seed": seed}), SEEDS)))
    finally:
        gw.router.on_event = real
        for st in gw.router.states["denoiser"].values():
            st.replica.delay_s = 0.0
    for seed, done in got.items():
        assert done["status"] == "completed", done
        assert contents(client, done["id"]) == want[seed], seed
    assert used == {"denoiser-0", "denoiser-1"}


def test_progress_events_follow_the_denoisers_steps(tmp_path):
    """With health probes every 50 ms, a long denoise stage on a replica announces its steps as progress events."""
    import dataclasses

    from optimized.serving.fleet_server import FleetGateway, create_fleet_app
    s = spec(denoisers=1)
    gw = FleetGateway.start(dataclasses.replace(s, routing=dataclasses.replace(s.routing, health_interval_s=0.05)))
    with TestClient(create_fleet_app(gw, output_dir=tmp_path)) as client:
        vid = client.post("/v1/videos", json={**BODY, "steps": 100}).json()["id"]
        events = client.get(f"/v1/videos/{vid}/events").text
        assert wait(client, vid)["status"] == "completed"
    import json
    steps = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: ")]
    denoise = [e["step"] for e in steps if e["kind"] == "progress" and e["stage"] == "denoise"]
    assert len(denoise) > 2 and denoise == sorted(set(denoise)) and denoise[-1] == 100   # each step once, in order
    assert all(e["total"] == 100 for e in steps if e["kind"] == "progress" and e["stage"] == "denoise")


def test_a_prompt_goes_to_the_denoiser_holding_its_text_embedding(fleet, colocated):
    import dataclasses
    client, gw = fleet
    picks, real = [], gw.router.on_event

    def record(kind, rid, data):
        if kind == "stage.completed" and data["role"] == "denoiser":
            picks.append((data["replica"], data["cache_hit"]))
        real(kind, rid, data)
    gw.router.on_event = record
    d0 = gw.router.states["denoiser"]["denoiser-0"]
    try:
        d0.backlog_s = 1e9                                   # denoiser-0 looks busy: the whale goes to denoiser-1
        assert make(client, {**BODY, "prompt": "a blue whale"})["status"] == "completed"
        d0.backlog_s = 0.0
        whale, fox = {**BODY, "prompt": "a blue whale", "seed": 3}, {**BODY, "seed": 3}
        for body in (whale, fox):
            assert make(client, body)["status"] == "completed"
        assert picks == [("denoiser-1", False), ("denoiser-1", True), ("denoiser-0", True)]
        gw.router.routing = dataclasses.replace(gw.router.routing, affinity=False)
        assert make(client, whale)["status"] == "completed"   # without affinity: the tie goes to denoiser-0
        assert picks[-1] == ("denoiser-0", False)
    finally:
        gw.router.on_event = real
        gw.router.routing = dataclasses.replace(gw.router.routing, affinity=True)
        d0.backlog_s = 0.0


def test_delete_of_an_unfinished_fleet_video_cancels_it_and_leaves_nothing(fleet):
    client, gw = fleet
    vid = client.post("/v1/videos", json={**BODY, "steps": 60}).json()["id"]
    assert client.delete(f"/v1/videos/{vid}").json() == {"id": vid, "object": "video.deleted", "deleted": True}
    assert client.get(f"/v1/videos/{vid}").status_code == 404
    t0 = time.monotonic()
    while gw.programs and time.monotonic() - t0 < 60:        # the program ends at its next stage boundary
        time.sleep(0.05)
    assert not gw.programs
    time.sleep(0.2)
    assert not [p for p in client.app.state.store.output_dir.iterdir() if p.name.startswith(vid)]


def test_transport_not_wired_to_the_backend_is_refused():
    import dataclasses

    from optimized.fleet.deployment import DeploymentError
    from optimized.serving.fleet_server import FleetGateway
    with pytest.raises(DeploymentError, match="transport: 'shared_memory' is not wired to placement.backend local"):
        FleetGateway.start(dataclasses.replace(spec(), transport="shared_memory"))


def _tamper_decoder_input(gw, fn):
    """Run the decoder's stage on tensors changed in transit by fn(name, tensor)."""
    st = gw.router.states["decoder"]["decoder-0"]
    real = st.replica.run_stage

    def in_transit(call):
        manifest, tensors = call.payload
        return real(dataclasses.replace(call, payload=(manifest, {n: fn(n, t) for n, t in tensors.items()})))
    st.replica.run_stage = in_transit
    return lambda: delattr(st.replica, "run_stage")


def test_negative_control_a_dtype_cast_in_transit_fails_naming_the_manifest_field(fleet):
    client, gw = fleet
    undo = _tamper_decoder_input(gw, lambda n, t: t.to(torch.bfloat16) if n.endswith("latents.vision") else t)
    try:
        done = make(client)
    finally:
        undo()
    assert done["status"] == "failed"
    assert "entries[denoise.latents.vision].dtype: declared torch.float32, received torch.bfloat16" in \
        done["error"]["message"]


def test_negative_control_values_rounded_in_transit_change_the_video(fleet, colocated):
    """The bitwise comparison has power where the manifest cannot see: latents rounded through bf16 (dtype, shape
    and bytes as declared) give another video."""
    client, gw = fleet
    undo = _tamper_decoder_input(gw, lambda n, t: t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t)
    try:
        done = make(client)
    finally:
        undo()
    assert done["status"] == "completed"
    assert contents(client, done["id"])["thumbnail"] != colocated["thumbnail"]


def test_denoiser_dying_mid_request_fails_over_and_writes_once(fleet, colocated, tmp_path):
    client, gw = fleet
    reps = {rid: st.replica for rid, st in gw.router.states["denoiser"].items()}
    first = gw.router.place(StagePlan("denoiser", 1.0))[0].replica.replica_id
    reps[first].dead = True                                    # the router's pick dies when it is called
    r = client.post("/v1/videos", json=BODY)
    vid = r.json()["id"]
    events = client.get(f"/v1/videos/{vid}/events").text
    done = wait(client, vid)
    assert done["status"] == "completed", done
    assert contents(client, vid) == colocated                  # the same video, from the other replica
    assert events.count("event: request.failover") == 1 and f"{first} died" in events
    assert events.count("event: request.completed") == 1
    files = sorted(p.name for p in client.app.state.store.output_dir.iterdir() if p.name.startswith(vid))
    assert files == [f"{vid}.json", f"{vid}.mp4", f"{vid}.png"]


def test_no_denoiser_left_fails_with_one_clear_error(fleet):
    client, gw = fleet
    for st in gw.router.states["denoiser"].values():
        st.replica.dead = True
    done = make(client)
    assert done["status"] == "failed"
    msg = done["error"]["message"]
    assert "stage denoiser could not complete" in msg and "completed stages: encoder" in msg
    vid = done["id"]
    assert not [p for p in client.app.state.store.output_dir.iterdir() if p.name.startswith(vid)]
