"""Wan VAE optimized decode/encode on CPU: the chunked loop's convolutions of >= MKLDNN_MIN_NUMEL input elements go
to oneDNN, not the native `slow_conv3d` / `_slow_conv2d` fallback PyTorch picks for batch-1 3x3 convs with
N*C*D*H <= 20480 (W ignored: a 1-latent-frame chunk at a wide stage), with the same numbers as the default dispatch.
Speed itself is measured by tools/bench_vae.py, not here."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from manifests.wan import canonical_key_shapes, load_variant
from parity.weights import random_state_dict

import optimized.models.wan as opt
from optimized.runtime.scheduler import run_request
from optimized.models.wan import vae as V

SLOW = ("aten::slow_conv3d_forward", "aten::_slow_conv2d_forward", "aten::slow_conv3d", "aten::_slow_conv2d")
rel = lambda a, b: ((a - b).norm() / b.norm()).item()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_chunked_decode_and_encode_avoid_the_slow_conv_fallback():
    cfg = load_variant("tiny-2.2")
    fast = opt.load_fast_vae(cfg, random_state_dict(canonical_key_shapes(cfg), 0))
    z = torch.randn(1, cfg.z_dim, 3, 2, 3)
    video = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        run_request(opt.WanVaeDecodeKernel(fast), opt.DecodeRequest("d", z, 1))
        run_request(opt.WanVaeEncodeKernel(fast), opt.EncodeRequest("e", video, 1))
    numel = lambda shape: torch.Size(shape).numel()
    big_slow = [(e.name, e.input_shapes[0]) for e in p.events()
                if e.name in SLOW and e.input_shapes and numel(e.input_shapes[0]) >= V.MKLDNN_MIN_NUMEL]
    assert not big_slow, big_slow
    assert sum(e.name == "aten::mkldnn_convolution" for e in p.events()) >= 20   # the wide stages run on oneDNN


@pytest.mark.parametrize("shape,w,stride,padding", [
    ((1, 6, 3, 32, 32), (6, 6, 3, 3, 3), (1, 1, 1), (0, 1, 1)),      # causal conv of a 1-frame chunk (+2 cached)
    ((1, 12, 3, 16, 16), (24, 12, 3, 1, 1), (1, 1, 1), (0, 0, 0)),   # temporal upsample conv
    ((1, 8, 5, 16, 16), (8, 8, 3, 1, 1), (2, 1, 1), (0, 0, 0)),      # temporal downsample conv (stride 2)
    ((2, 6, 2, 32, 32), (6, 6, 1, 1, 1), (1, 1, 1), (0, 0, 0)),      # 1x1x1 (shortcut / post_quant_conv)
    ((1, 12, 3, 8, 8), (12, 12, 3, 3, 3), (1, 1, 1), (0, 1, 1)),     # below the threshold: default dispatch
])
def test_conv3d_equals_default_dispatch(shape, w, stride, padding):
    g = torch.Generator().manual_seed(0)
    x, wt, b = torch.randn(shape, generator=g), torch.randn(w, generator=g), torch.randn(w[0], generator=g)
    want = F.conv3d(x, wt, b, stride=stride, padding=padding)
    assert V._direct_mkldnn(x) == (x.numel() >= V.MKLDNN_MIN_NUMEL)
    assert rel(V.conv3d(x, wt, b, stride, padding), want) < 1e-6
    # non-contiguous input (a transposed view) is accepted
    xt = x.transpose(3, 4).contiguous().transpose(3, 4)
    assert rel(V.conv3d(xt, wt, b, stride, padding), want) < 1e-6


def test_conv2d_equals_default_dispatch_and_fallbacks():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(1, 6, 40, 41, generator=g), torch.randn(4, 6, 3, 3, generator=g), torch.randn(4, generator=g)
    assert V._direct_mkldnn(x)
    for stride, padding in ((1, 1), (2, 0)):
        assert rel(V.conv2d(x, w, b, stride, padding), F.conv2d(x, w, b, stride=stride, padding=padding)) < 1e-6
    saved = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False                 # the user's switch is respected
    try:
        assert not V._direct_mkldnn(x)
        assert torch.equal(V.conv2d(x, w, b, 1, 1), F.conv2d(x, w, b, padding=1))
    finally:
        torch.backends.mkldnn.enabled = saved
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()   # bf16 keeps the default dispatch
    assert not V._direct_mkldnn(xb)
    assert torch.equal(V.conv2d(xb, wb, bb, 1, 1), F.conv2d(xb, wb, bb, padding=1))
