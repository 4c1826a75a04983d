"""Co-located vs disaggregated vs replicas on this machine: throughput and latency of N requests, as ratios, plus the
bytes one request moves between roles at released sizes (analytic), checked against the bytes counted at tiny sizes.

    python tools/bench_fleet.py                       # wan tiny-2.1-t2v, 4 requests, 32x32x5, 2 steps
    python tools/bench_fleet.py --requests 8 --steps 4

Topologies (all in this process's machine, CPU, fp32; one request's video is bitwise the same in all three):
    colocated   one Engine, the N requests started together (its scheduler batches them)
    disagg      encoder, denoiser, decoder: one spawned process each, shared-memory transfers; N requests from N
                threads (pipelined across roles, one stage at a time per role)
    replicas    the same with two denoiser processes
Ratios are against colocated (> 1: faster). On a machine with fewer cores than processes the fleet pays for
oversubscription; the point of the figure is the overhead of the split, not a speedup.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class ReleasedSize:
    """What one request of a released model moves (the formula `request_bytes` reads)."""
    name: str
    latent_channels: int
    temporal_compression: int
    spatial_compression: int
    frames: int
    height: int
    width: int
    text_tokens: int                  # prompt ids per prompt (int64), the negative prompt's as many (CFG)


RELEASED = (ReleasedSize("Wan2.1-T2V-1.3B 480p 81f", 16, 4, 8, 81, 480, 832, 512),
            ReleasedSize("Wan2.1-T2V-14B 720p 81f", 16, 4, 8, 81, 720, 1280, 512))


def request_bytes(s: ReleasedSize) -> dict[str, int]:
    """Bytes per transfer of one text-to-video request: ids (gateway -> encoder -> denoiser), fp32 latents
    [C, 1 + (F-1)/t, H/s, W/s] (denoiser -> decoder), uint8 frames [F, H, W, 3] (decoder -> gateway)."""
    ids = 2 * s.text_tokens * 8
    latents = s.latent_channels * (1 + (s.frames - 1) // s.temporal_compression) * \
        (s.height // s.spatial_compression) * (s.width // s.spatial_compression) * 4
    frames = s.frames * s.height * s.width * 3
    return {"gateway->encoder": ids, "encoder->denoiser": ids, "denoiser->decoder": latents,
            "decoder->gateway": frames}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="wan")
    ap.add_argument("--variant", default="tiny-2.1-t2v")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--frames", type=int, default=5)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.steps < 1:
        print("bench_fleet: --requests and --steps must be >= 1", file=sys.stderr)
        return 2

    import torch

    from optimized.fleet.roles import LocalFleet
    from optimized.programs import start_video
    from optimized.serving.loading import load_engine
    from optimized.serving.requests import build_request

    engine = load_engine(args.family, None, args.variant)
    reqs = [build_request(engine, prompt_ids=[3, 5, 7, 9, 11, 13, 15, 17], num_frames=args.frames, height=args.size,
                          width=args.size, num_steps=args.steps, seed=100 + i)[0] for i in range(args.requests)]

    def colocated():
        t0 = time.perf_counter()
        handles = [start_video(engine, r, request_id=f"bench-{i}-{time.monotonic_ns()}") for i, r in enumerate(reqs)]
        done = []
        for h in handles:
            res = h.result()
            done.append((time.perf_counter() - t0, res.frames))
        return time.perf_counter() - t0, [d for d, _ in done], [f for _, f in done], None

    def fleet_run(denoisers):
        with LocalFleet(args.family, args.variant, denoisers=denoisers, processes=True,
                        transport="shared_memory") as fleet:
            fleet.generate(reqs[0], request_id="warm")                  # first call per process: lazy inits
            out: list = [None] * len(reqs)
            t0 = time.perf_counter()

            def one(i):
                r = fleet.generate(reqs[i], request_id=f"r{i}")
                out[i] = (time.perf_counter() - t0, r)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        return wall, [o[0] for o in out], [o[1].frames for o in out], [o[1] for o in out]

    colocated()                                                          # warm the co-located engine
    from optimized.programs import generate_video
    # the parity reference: each request alone on the co-located engine (the batched co-located run may differ
    # from it in the last bits: batch-shaped matmuls; the fleet runs each stage one request at a time)
    alone = [generate_video(engine, r, request_id=f"alone-{i}").frames for i, r in enumerate(reqs)]
    rows = {}
    for name, fn in (("colocated", colocated), ("disagg", lambda: fleet_run(1)), ("replicas", lambda: fleet_run(2))):
        wall, lat, frames, results = fn()
        rows[name] = (wall, sum(lat) / len(lat), frames, results)
    base_wall, base_lat, _, _ = rows["colocated"]
    print(f"bench_fleet {args.family}:{args.variant}  {args.requests} requests {args.size}x{args.size}x{args.frames}, "
          f"{args.steps} steps, CPU fp32  ({platform.node()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d', time.gmtime())}, torch {torch.__version__})")
    print(f"{'topology':<10} {'wall s':>8} {'req/s':>8} {'mean latency s':>15} {'throughput x':>13} "
          f"{'latency x':>10}  bitwise vs each request alone on the co-located engine")
    for name, (wall, lat, frames, _) in rows.items():
        same = all(torch.equal(a, b) for a, b in zip(frames, alone))
        print(f"{name:<10} {wall:8.2f} {len(frames) / wall:8.3f} {lat:15.2f} {base_wall / wall:13.2f} "
              f"{base_lat / lat:10.2f}  {same}")
    # bytes: counted at tiny sizes vs the formula at the same sizes, then the formula at released sizes
    counted = rows["disagg"][3][0]
    lat_shape = counted.latents["vision"].shape                           # [1, C, T, h, w]
    tiny = ReleasedSize("tiny", lat_shape[1], 4, args.size // lat_shape[-1], args.frames, args.size, args.size, 0)
    formula = request_bytes(tiny)
    ids = {k: v for k, v in counted.bytes_by_transfer.items() if k.startswith(("gateway->", "encoder"))}
    got = {f"{k.split('->')[0].rsplit('-', 1)[0]}->{k.split('->')[1]}": v for k, v in counted.bytes_by_transfer.items()}
    ok = got["denoiser->decoder"] == formula["denoiser->decoder"] and got["decoder->gateway"] == \
        formula["decoder->gateway"] and all(v == sum(t.numel() * 8 for t in (reqs[0].text_ids,
                                                                            reqs[0].negative_text_ids))
                                             for v in ids.values())
    print(f"bytes per request, counted at tiny size: {got} (formula: latents {formula['denoiser->decoder']}, frames "
          f"{formula['decoder->gateway']}; ids = the request's token ids)  -> {'agree' if ok else 'DISAGREE'}")
    for s in RELEASED:
        b = request_bytes(s)
        print(f"bytes per request at {s.name}: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in b.items()) +
              f"; total {sum(b.values()) / 2**20:.1f} MiB")
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
