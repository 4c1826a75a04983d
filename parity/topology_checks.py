"""Parity across topologies: the same requests through a fleet of role processes equal the co-located engine,
bitwise on CPU fp32 (`fvparity run FAMILY --level C1|C4 --topology disagg|replicas|inprocess`).

    disagg     encoder, denoiser and decoder each in its own spawned process, shared-memory transfers
    replicas   the same with two denoiser replicas: two requests (different seeds), each placed on its own replica
    inprocess  every role in this process, in-process transfers (the same stages, manifests and checks; the default
               test suite runs this one)

C1 compares what crosses into and out of the denoise loop: the denoiser's input tensors (the conditioned request,
as the co-located program conditioned it) and its final latents by modality. C4 compares the artifact: the uint8
frames (and the audio where the family has sound), bytes and sha256. Both sides load the same variant with the same
seed: the same weights, so any difference is the topology's.

Negative controls (`fault=`), each must be caught by the fleet naming the manifest field:
    drop_last_chunk   the denoiser -> decoder transfer loses the last chunk of its largest tensor
                      -> entries[denoise.latents.vision].chunks
    cast_in_transit   that transfer's latents arrive as bfloat16 -> entries[denoise.latents.vision].dtype
    stale_cache       replicas with denoiser caches: a request is routed to a replica holding a stale entry (the
                      output of another request) under its key -> cache_key
A fault run yields one row: passed when the fleet refused the request with the expected field, failed otherwise (a
planted fault that went unnoticed, or was named wrongly).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

TOPOLOGIES = ("disagg", "replicas", "inprocess")
LEVELS = ("C1", "C4")
FAULTS = {"drop_last_chunk": "entries[denoise.latents.vision].chunks",
          "cast_in_transit": "entries[denoise.latents.vision].dtype",
          "stale_cache": "cache_key"}
# tiny cases per served family: (case name, variant, with a conditioning image). The harness names families; the
# fleet does not.
CASES = {"wan": (("t2v", "tiny-2.1-t2v", False), ("ti2v", "tiny-2.2-ti2v", True)),
         "cosmos3": (("t2v", "tiny", False), ("i2v", "tiny", True))}   # cosmos3 i2v: the encoder role encodes
CHUNK_BYTES = 128                     # tiny tensors still cross in several chunks (the drop-a-chunk control needs >1)


@dataclass(frozen=True)
class TopologyRow:
    family: str
    level: str
    topology: str
    case: str
    check: str
    ok: bool
    detail: str


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _same(name: str, got: Any, want: Any) -> tuple[bool, str]:
    if got is None or want is None:
        return got is None and want is None, f"{name}: {'both none' if got is want else 'one side missing'}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"{name}: {list(got.shape)} {got.dtype} vs co-located {list(want.shape)} {want.dtype}"
    if torch.equal(got, want):
        return True, f"{name}: bitwise equal ({_sha(got)})"
    d = (got.double() - want.double()).abs()
    return False, f"{name}: max |diff| {d.max().item():.3e} at {tuple(int(i) for i in torch.nonzero(d == d.max())[0])}"


def _requests(engine: Any, image: bool, seeds: tuple[int, ...]) -> list[tuple[Any, Any]]:
    from optimized.serving.requests import build_request
    pixels = None
    if image:
        g = torch.Generator().manual_seed(11)
        pixels = torch.rand(3, 32, 32, generator=g) * 2 - 1
    return [build_request(engine, prompt_ids=[3, 5, 7, 9], num_frames=5, height=32, width=32, num_steps=2,
                          seed=s, image=pixels) for s in seeds]


def _case_rows(family: str, level: str, topology: str, case: str, variant: str, image: bool,
               fault: str | None, fleet_seed: int = 0) -> list[TopologyRow]:
    from optimized.fleet.roles import LocalFleet
    from optimized.fleet.transfer import TransferError, pack
    from optimized.fleet.transports import FaultyTransport
    from optimized.programs import generate_video
    from optimized.serving.loading import load_engine

    row = lambda check, ok, detail: TopologyRow(family, level, topology, case, check, ok, detail)
    engine = load_engine(family, None, variant)
    replicas = 2 if topology == "replicas" or fault == "stale_cache" else 1
    reqs = _requests(engine, image, seeds=(7, 8)[:replicas])
    processes = topology != "inprocess" and fault is None   # faults damage in-process transfers (same code path)
    fleet = LocalFleet(family, variant, seed=fleet_seed, denoisers=replicas, processes=processes,
                       transport="shared_memory" if processes else "inprocess", chunk_bytes=CHUNK_BYTES,
                       denoiser_cache_entries=4 if fault == "stale_cache" else 0)
    rows: list[TopologyRow] = []
    with fleet:
        if fault is not None:
            want = FAULTS[fault]
            try:
                if fault == "stale_cache":
                    first = fleet.generate(*reqs[0])                       # cached on the replica it ran on
                    other = next(w for w in fleet.workers["denoiser"] if w.replica_id != first.replicas["denoiser"])
                    probe = _key_of(fleet, reqs[1])
                    stale = next(iter(_resident_entries(fleet, first.replicas["denoiser"])))
                    other.plant(probe, stale)                              # request 0's output under request 1's key
                    fleet.route_to[probe] = other.replica_id
                    fleet.generate(*reqs[1])
                else:
                    dec = fleet.workers["decoder"][0]
                    dec.transport = FaultyTransport(
                        dec.transport, only_stage="denoise",
                        **({"drop_last_chunk": "*"} if fault == "drop_last_chunk" else
                           {"cast": ("*", torch.bfloat16)}))
                    fleet.generate(*reqs[0])
            except TransferError as e:   # planted in in-process transfers (the same pack / chunk / check code)
                return [row(f"fault {fault}", e.field == want, f"caught: {e}" if e.field == want else
                            f"caught on the wrong field {e.field!r} (want {want!r}): {e}")]
            return [row(f"fault {fault}", False, f"planted {fault} went unnoticed (want a TransferError on {want})")]
        results = [fleet.generate(r, img, request_id=f"{case}-{i}") for i, (r, img) in enumerate(reqs)]
    for i, ((req, img), got) in enumerate(zip(reqs, results)):
        co = generate_video(engine, req, image=img, request_id=f"co-{case}-{i}")
        tag = f"request {i} on {got.replicas['denoiser']}"
        if level == "C1":
            _, co_in = pack({"request": co.request}, request_id="co", stage="encode", producer="co",
                            consumer="denoiser", prefix="encode")
            for name in sorted(set(co_in) | set(got.denoiser_input)):
                ok, detail = _same(name, got.denoiser_input.get(name), co_in.get(name))
                rows.append(row(f"{tag}: denoiser input {name}", ok, detail))
            for mod in sorted(set(co.latents) | set(got.latents)):
                ok, detail = _same(f"latents[{mod}]", got.latents.get(mod), co.latents.get(mod))
                rows.append(row(f"{tag}: final latents {mod}", ok, detail))
        else:
            ok, detail = _same("frames", got.frames, co.frames)
            rows.append(row(f"{tag}: frames uint8", ok, detail))
            ok, detail = _same("audio", got.audio, co.audio)
            rows.append(row(f"{tag}: audio", ok, detail))
            rows.append(row(f"{tag}: fps", got.fps == co.fps, f"{got.fps} vs co-located {co.fps}"))
        rows.append(row(f"{tag}: bytes moved", got.bytes_moved == sum(m.nbytes for m in got.manifests) > 0,
                        f"{got.bytes_moved} B ({', '.join(f'{k} {v}' for k, v in got.bytes_by_transfer.items())})"))
    if replicas > 1:
        used = sorted({r.replicas["denoiser"] for r in results})
        rows.append(row("replicas: each denoiser replica served a request", len(used) == replicas, f"{used}"))
    return rows


def _key_of(fleet: Any, req_img: tuple[Any, Any]) -> str:
    """The denoiser input key a request will carry (its encoder output's content key), computed as the fleet does."""
    from optimized.fleet.roles import input_key
    enc = fleet.workers["encoder"][0]
    from optimized.fleet.transfer import pack
    m, t = pack({"request": req_img[0], "image": req_img[1]}, request_id="probe", stage="request",
                producer="gateway", consumer="encoder", chunk_bytes=fleet.chunk_bytes, prefix="request")
    m, t = enc.run_stage(m, t)
    return input_key(m, t, fleet.workers["denoiser"][0].weights_version)


def _resident_entries(fleet: Any, replica_id: str) -> list:
    w = next(w for w in fleet.workers["denoiser"] if w.replica_id == replica_id)
    if w.body is None:
        raise ValueError("stale_cache plants from an in-process replica's cache")
    return list(w.body.cache.values())


def run_topology_checks(family: str, level: str, topology: str, *, fault: str | None = None,
                        cases: tuple[str, ...] | None = None, fleet_seed: int = 0) -> list[TopologyRow]:
    """Rows for every case of `family` (or `cases`). `fleet_seed` != 0 loads the fleet's roles with other random
    weights than the co-located engine (seed 0): the harness's own control, every C1 / C4 comparison must fail."""
    if family not in CASES:
        raise ValueError(f"family {family!r}: topology checks cover {', '.join(CASES)} (the families with video "
                         f"serving hooks)")
    if level not in LEVELS:
        raise ValueError(f"--level {level}: topology checks run {', '.join(LEVELS)}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"--topology {topology!r}: one of {', '.join(TOPOLOGIES)}")
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown topology fault {fault!r} (known: {', '.join(FAULTS)})")
    rows: list[TopologyRow] = []
    for case, variant, image in CASES[family]:
        if cases is not None and case not in cases:
            continue
        rows += _case_rows(family, level, topology, case, variant, image, fault, fleet_seed)
        if fault is not None:
            break                     # one case per planted fault
    return rows


def topology_report(family: str, level: str, topology: str, *, fault: str | None = None):
    """The rows as a parity Report (what `fvparity run ... --topology` prints); bad arguments are SetupError."""
    from parity.errors import SetupError
    from parity.report import CheckResult, Report
    try:
        rows = run_topology_checks(family, level, topology, fault=fault)
    except ValueError as e:
        raise SetupError(str(e)) from None
    report = Report(family=family, level=level, settings={"topology": topology, "fault": fault})
    for r in rows:
        report.checks.append(CheckResult(name=f"{r.topology} {r.case}: {r.check}", passed=r.ok, detail=r.detail,
                                         divergence=None if r.ok else r.check))
    return report
