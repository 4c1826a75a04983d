"""Benchmark: the engine against the peer it replaces (diffusers 0.42.1), same weights, same request, one process.

Weights are drawn on the diffusers model, saved with `save_pretrained` and converted with fvconvert's in-memory
converter (so both sides run the bytes a user would convert). Outputs are asserted equal (fp32: rel L2 <= 1e-5;
cosmos3 bf16: the parity contract's C1 bf16 tolerance) BEFORE any time is printed. Times are medians of --repeats runs after one warm-up run per side (the warm-up of a
compiled engine is its compile time, printed separately); wall and CPU (process) time; ratio = diffusers / engine
(> 1: the engine is faster). Not a test: speed is never asserted.

  cosmos3:  the denoise loop (diffusers: first transformer call .. last step callback of Cosmos3OmniPipeline with
            explicit latents and token ids; engine: submit .. done), 1 request and N requests (diffusers one by one,
            the engine batching them), graph modes eager / compile.
  wan-vae:  AutoencoderKLWan.decode vs the chunked decode loop: time and peak live tensor bytes (CPU: a dispatch
            mode that sums live storages at op boundaries; CUDA: max_memory_allocated).

    python tools/bench_vs_diffusers.py                               # issue-13 CPU configuration, 1 thread
    python tools/bench_vs_diffusers.py --only wan-vae
    python tools/bench_vs_diffusers.py --device cuda --dtype bf16 --released   # gpu_check: released sizes
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------------------------

class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages on `device`, sampled at every op boundary (op-internal workspaces are not
    seen; both sides are measured the same way)."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device, self.live, self.current, self.peak = device, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[ptr]
                self.current -= n
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                st = t.untyped_storage()
                if st.data_ptr() not in self.live and st.nbytes():
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def peak_bytes(fn, device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with PeakLiveBytes("cpu") as m:
        fn()
    return m.peak


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[float, float]:
    """(wall, cpu) seconds of one call; `fn` may return its own (wall, cpu) span instead."""
    sync(device)
    w, c = time.perf_counter(), time.process_time()
    span = fn()
    sync(device)
    if isinstance(span, tuple):
        return span
    return time.perf_counter() - w, time.process_time() - c


def medians(fn, device: str, repeats: int) -> tuple[float, float]:
    runs = [timed(fn, device) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """QK^T and PV of one SDPA call as executed (pad keys included; GQA: every query head reads a key head)."""
    b, h, s_q, d = query_shape
    return 4 * b * h * s_q * key_shape[-2] * d


def _count_cpu_sdpa() -> None:
    """FlopCounterMode knows the CUDA SDPA kernels but not the CPU flash kernel both sides run here; teach it."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if op not in flop_registry:
        register_flop_formula(op)(_sdpa_flops)


def counted_flops(fn) -> int:
    """Matmul + conv + attention FLOPs of one eager call of `fn`, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode
    _count_cpu_sdpa()
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(dtype: torch.dtype, device: str, shapes: list[tuple[int, int, int]], repeats: int = 10) -> float:
    """This core's best measured matmul rate (FLOP/s) over a large square product and the model's own GEMM shapes.
    The ceiling assumes no implementation runs the same FLOPs faster (SDPA is GEMM work too, and measures slower)."""
    best = 0.0
    for m, k, n in [(2048, 2048, 2048)] + shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(2):
            a @ b
        sync(device)
        t = time.perf_counter()
        for _ in range(repeats):
            a @ b
        sync(device)
        best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - t))
    return best


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_equal(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    r = rel_l2(got, want)
    if not r <= tol:
        sys.exit(f"bench_vs_diffusers: {name}: outputs differ (rel L2 {r:.2e} > {tol:.0e}); no timings printed")
    return "bitwise" if torch.equal(got.cpu(), want.cpu()) else f"rel L2 {r:.1e}"


# ----------------------------------------------------------------------------------------------------------------
# cosmos3 denoise loop
# ----------------------------------------------------------------------------------------------------------------

def cosmos3_transformer_config(args) -> dict:
    if args.released:  # Cosmos3-Nano (manifests/cosmos3/variants/nano.json), random weights
        from bench_convert import diffusers_config_for
        from manifests.cosmos3 import load_variant
        conf = diffusers_config_for(load_variant("nano"))
        conf.pop("_class_name")
        return conf
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                num_key_value_heads=max(args.hidden // 128, 1), head_dim=64, intermediate_size=args.hidden * 3,
                vocab_size=1024, latent_channel=48, latent_patch_size=2, patch_latent_dim=192,
                rope_axes_dim=[12, 10, 10])


def bench_cosmos3(args, out: list[list[str]]) -> None:
    import diffusers
    import make_generate_goldens as mg
    from make_goldens import randomize_weights

    from converters import convert_diffusers_dir_to_canonical_state_dict
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
    from manifests.parity import load_parity_contract
    from optimized import Engine

    dev, dtype = args.device, DTYPES[args.dtype]
    up = mg._import_upstream()
    tr = diffusers.Cosmos3OmniTransformer(**cosmos3_transformer_config(args)).eval()
    randomize_weights(tr, 0)
    with tempfile.TemporaryDirectory() as tmp:
        tr.save_pretrained(tmp)
        cfg, state = convert_diffusers_dir_to_canonical_state_dict(tmp)
    tr = tr.to(dev, dtype)

    # 960 vision tokens = 3 latent frames x (32/2) x (40/2): 9 frames of 512 x 640 (Wan2.2 VAE: 4x / 16x)
    frames, height, width = args.frames, args.height, args.width
    T, H, W = (frames - 1) // 4 + 1, height // 16, width // 16
    g = torch.Generator().manual_seed(5)
    sched = dict(mg.UNIPC_FIELDS, flow_shift=10.0)
    reqs = []
    for i in range(args.concurrent):
        reqs.append(Cosmos3GenerateRequest(
            text_ids=torch.randint(0, cfg.vocab_size, (args.text_len,), generator=g),
            negative_text_ids=torch.randint(0, cfg.vocab_size, (args.text_len // 4 + 1,), generator=g),
            latent_frames=T, latent_height=H, latent_width=W, num_steps=args.steps, guidance_scale=5.0, fps=24.0,
            seed=None, scheduler=UniPCConfig(**{k: sched[k] for k in mg.UNIPC_FIELDS}),
            noise_vision=torch.randn(1, cfg.latent_channels, T, H, W, generator=g)))
    tokens = T * (H // 2) * (W // 2)
    params = dict(scheduler=sched, sound_frames=0)
    pipe = mg.build_pipeline(up, tr, params, aux_seed=1)
    pipe.vae.to(dev)
    pipe.set_progress_bar_config(disable=True)

    def diffusers_run(req) -> tuple[torch.Tensor, tuple[float, float]]:
        marks = {}
        pipe.tokenize_prompt = lambda *a, **k: (req.text_ids.tolist(), req.negative_text_ids.tolist())

        def first_call(module, a, k):
            if "w" not in marks:
                sync(dev)
                marks["w"], marks["c"] = time.perf_counter(), time.process_time()

        def step_end(p, i, t, kw):
            sync(dev)
            marks["we"], marks["ce"] = time.perf_counter(), time.process_time()
            return {}

        h = tr.register_forward_pre_hook(first_call, with_kwargs=True)
        try:
            with torch.no_grad():
                res = pipe(prompt="(ids bypassed)", num_frames=frames, height=height, width=width, fps=24.0,
                           num_inference_steps=req.num_steps, guidance_scale=req.guidance_scale,
                           latents=req.noise_vision.clone().to(dev, dtype), output_type="latent",
                           callback_on_step_end=step_end, enable_safety_check=False)
        finally:
            h.remove()
        return res.video.float(), (marks["we"] - marks["w"], marks["ce"] - marks["c"])

    def diffusers_flops(rs) -> int:  # the transformer calls only: the region the times cover
        total, counters = [0], []

        def enter(module, a, k):
            from torch.utils.flop_counter import FlopCounterMode
            counters.append(FlopCounterMode(display=False))
            counters[-1].__enter__()

        def leave(module, a, k, o):
            counter = counters.pop()
            counter.__exit__(None, None, None)
            total[0] += counter.get_total_flops()

        _count_cpu_sdpa()
        hooks = [tr.register_forward_pre_hook(enter, with_kwargs=True),
                 tr.register_forward_hook(leave, with_kwargs=True)]
        try:
            diffusers_all(rs)
        finally:
            for h in hooks:
                h.remove()
        return total[0]

    def diffusers_all(rs):
        outs, wall, cpu = [], 0.0, 0.0
        for r in rs:
            o, (w, c) = diffusers_run(r)
            outs.append(o)
            wall, cpu = wall + w, cpu + c
        return outs, (wall, cpu)

    engines = {}

    def engine_all(rs, mode):
        eng = engines[mode]
        hs = [eng.submit(r) for r in rs]
        eng.run_until_idle()
        return [h.result()["latents"]["vision"].float() for h in hs]

    for mode in sorted(set(args.graph) | {"eager"}):  # eager also counts the engine's FLOPs for the ceiling
        eng = Engine.from_state_dict(cfg, state, dev, dtype, weights_version="bench", cfg_policy="batched")
        eng.model.configure_graph(mode, cfg_policy="batched", variant="bench")
        engines[mode] = eng
    D, I = cfg.hidden_size, cfg.intermediate_size
    peak = matmul_peak(dtype, dev, [(tokens, D, I), (tokens, I, D), (tokens, D, D)])

    # bf16: the C1 loop tolerance of the parity contract (measured bf16 noise after the steps at guidance 5)
    ceilings: list[str] = []
    tol = 1e-5 if dtype == torch.float32 else \
        load_parity_contract("cosmos3").tolerance("C1", "bfloat16", dev.split(":")[0]).rel_l2
    for n in sorted({1, args.concurrent}):
        rs = reqs[:n]
        want, _ = diffusers_all(rs)  # warm-up + the outputs every engine mode must match
        d_wall, d_cpu = medians(lambda: diffusers_all(rs)[1], dev, args.repeats)
        for mode in args.graph:
            t0 = time.perf_counter()
            got = engine_all(rs, mode)  # warm-up (compiles the buckets this workload needs)
            warm = time.perf_counter() - t0
            eq = "; ".join(assert_equal(f"cosmos3 {n} req {mode}", a, b, tol) for a, b in zip(got, want))
            e_wall, e_cpu = medians(lambda: engine_all(rs, mode), dev, args.repeats)
            out.append([f"cosmos3 denoise, {n} request(s), engine {mode}", f"{d_wall:.3f} / {d_cpu:.3f}",
                        f"{e_wall:.3f} / {e_cpu:.3f}", f"{d_wall / e_wall:.2f}x / {d_cpu / e_cpu:.2f}x",
                        f"first run {warm:.1f} s; {eq if n == 1 else eq.split(';')[0] + ' ...'}"])
        # the ceiling at equal work: the engine's FLOPs at this core's best matmul rate, against diffusers' time
        d_flops = diffusers_flops(rs)
        e_flops = counted_flops(lambda: engine_all(rs, "eager"))
        d_time, clock = (d_wall, "wall") if dev.startswith("cuda") else (d_cpu, "CPU")
        ceilings.append(f"# ceiling, {n} request(s): diffusers {d_flops / 1e9:.4g} GFLOP in {d_time:.2f} s {clock} = "
                        f"{d_flops / d_time / 1e9:.1f} GFLOP/s ({d_flops / d_time / peak:.0%} of the measured matmul "
                        f"peak {peak / 1e9:.1f} GFLOP/s); engine {e_flops / 1e9:.4g} GFLOP "
                        f"({e_flops / d_flops:.0%} of diffusers'), {e_flops / peak:.2f} s at that peak: the "
                        f"engine's work allows at most {d_time * peak / e_flops:.2f}x here")
    print(f"# cosmos3: hidden {cfg.hidden_size}, layers {cfg.num_layers}, heads {cfg.num_heads}/{cfg.num_kv_heads}x"
          f"{cfg.head_dim}, {tokens} vision tokens/sample, text {args.text_len}/{args.text_len // 4 + 1}, "
          f"{args.steps} steps, CFG 5 (diffusers: cond + uncond forward per step)", flush=True)
    print("\n".join(ceilings), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Wan VAE decode
# ----------------------------------------------------------------------------------------------------------------

def bench_wan_vae(args, out: list[list[str]]) -> None:
    import diffusers
    from make_vae_goldens import randomize_weights

    import optimized.models.wan as opt
    from converters.engine import convert_to_state_dict
    from optimized.runtime.scheduler import run_request

    dev, dtype = args.device, DTYPES[args.dtype]
    if args.released:  # Wan2.1 VAE (base 96, z 16): 81 frames 480p = 21 latent frames 60 x 104
        conf, shape = dict(base_dim=96, z_dim=16), (1, 16, 21, 60, 104)
    else:
        conf = dict(base_dim=args.vae_base, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                    temperal_downsample=[False, True, True])
        shape = (1, 16, args.vae_frames, *args.vae_hw)
    model = diffusers.AutoencoderKLWan(**conf).eval()
    randomize_weights(model, 0)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        cfg, state = convert_to_state_dict("wan", "diffusers", tmp)
    model = model.to(dev, dtype)
    fast = opt.load_fast_vae(cfg, state, dev, dtype)
    kernel = opt.WanVaeDecodeKernel(fast)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dev, dtype)

    def d_run():
        with torch.no_grad():
            return model.decode(z).sample

    def o_run():
        return run_request(kernel, opt.DecodeRequest("bench", z, 1), memory_budget_bytes=1 << 40)

    def c_run():  # decode_chunk with the cache updated in place (one conv cache alive, as upstream's feat_cache)
        cache, chunks = opt.ConvCache(), []
        with torch.no_grad():
            for a in range(z.shape[2]):
                video, cache = fast.decode_chunk(z[:, :, a:a + 1], cache, a == 0, consume=True)
                chunks.append(video)
        return torch.cat(chunks, 2)

    want = d_run()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    eqs = {"loop": assert_equal("wan vae decode", o_run(), want, tol),
           "consume": assert_equal("wan vae decode (consume)", c_run(), want, tol)}
    del want
    d_peak = peak_bytes(d_run, dev)
    d_wall, d_cpu = medians(d_run, dev, args.repeats)
    for name, fn in (("loop", o_run), ("consume", c_run)):
        o_peak = peak_bytes(fn, dev)
        o_wall, o_cpu = medians(fn, dev, args.repeats)
        label = "scheduler loop (pre-step cache kept)" if name == "loop" else "decode_chunk(consume=True)"
        out.append([f"wan VAE decode {list(shape)}, {label}", f"{d_wall:.3f} / {d_cpu:.3f}",
                    f"{o_wall:.3f} / {o_cpu:.3f}", f"{d_wall / o_wall:.2f}x / {d_cpu / o_cpu:.2f}x",
                    f"peak {d_peak / 2**20:.1f} (diffusers) vs {o_peak / 2**20:.1f} MiB: "
                    f"{o_peak / max(d_peak, 1):.2f}x of diffusers; {eqs[name]}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["cosmos3", "wan-vae"], default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graph", nargs="+", default=["eager", "compile"], choices=["eager", "compile", "cuda"])
    ap.add_argument("--released", action="store_true", help="released sizes, random weights (GPU)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--text-len", type=int, default=64)
    ap.add_argument("--frames", type=int, default=9, help="pixel frames (4k + 1)")
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--vae-base", type=int, default=16)
    ap.add_argument("--vae-frames", type=int, default=5)
    ap.add_argument("--vae-hw", type=int, nargs=2, default=(32, 32))
    args = ap.parse_args()
    if args.released:
        args.frames, args.height, args.width = 121, 720, 1280
    torch.set_num_threads(args.threads)
    rows: list[list[str]] = []
    if args.only in (None, "cosmos3"):
        bench_cosmos3(args, rows)
    if args.only in (None, "wan-vae"):
        bench_wan_vae(args, rows)
    from tabulate import tabulate
    import diffusers
    print(f"# bench_vs_diffusers  {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()} "
          f"{platform.processor() or ''}  torch {torch.__version__}  diffusers {diffusers.__version__}  "
          f"threads {torch.get_num_threads()}  {args.device} {args.dtype}  medians of {args.repeats}  "
          f"load avg {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}")
    print(tabulate(rows, headers=["workload", "diffusers wall / cpu s", "engine wall / cpu s",
                                  "ratio wall / cpu", "notes"]))


if __name__ == "__main__":
    main()
