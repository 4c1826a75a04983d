"""TransferManifest checks name the field that disagrees; every transport moves tensors bitwise, counts bytes, and
consumes a transfer once; shared memory is released after consumption (no /dev/shm leak), also across processes;
torch.distributed (gloo) moves a manifest between two ranks."""

import multiprocessing as mp
import os
from dataclasses import dataclass

import pytest
import torch

from optimized.fleet.transfer import (
    TensorEntry,
    TransferError,
    TransferManifest,
    content_key,
    pack,
    unpack,
)
from optimized.fleet.transports import (
    FaultyTransport,
    InProcessTransport,
    SharedMemoryTransport,
    TorchDistTransport,
    release,
    segment_exists,
)


@dataclass(frozen=True)
class Req:
    text_ids: torch.Tensor
    steps: int
    extra: tuple = ()


def value():
    g = torch.Generator().manual_seed(0)
    return {"request": Req(torch.arange(7, dtype=torch.int64), 3, (torch.randn(2, 3, generator=g), "x")),
            "latents": {"vision": torch.randn(1, 4, 2, 3, 3, generator=g)}, "fps": 16.0, "none": None}


def packed(chunk_bytes=64):
    return pack(value(), request_id="r1", stage="denoise", producer="denoiser-0", consumer="decoder",
                chunk_bytes=chunk_bytes)


def test_pack_names_every_tensor_and_unpack_restores_the_value():
    m, t = packed()
    assert sorted(t) == ["out.latents.vision", "out.request.extra.0", "out.request.text_ids"]
    e = m.entry("out.latents.vision")
    assert (e.shape, e.dtype, e.nbytes, e.chunks) == ((1, 4, 2, 3, 3), "torch.float32", 72 * 4, 5)   # 288 B / 64
    assert m.nbytes == 7 * 8 + 6 * 4 + 288 and m.completion_event_id == "r1/denoise.done"
    back = unpack(m, t)
    v = value()
    assert torch.equal(back["latents"]["vision"], v["latents"]["vision"]) and back["fps"] == 16.0
    assert isinstance(back["request"], Req) and back["request"].steps == 3 and back["request"].extra[1] == "x"
    assert torch.equal(back["request"].text_ids, v["request"].text_ids) and back["none"] is None


@pytest.mark.parametrize("damage, field", [
    (lambda t: t.pop("out.latents.vision"), "entries[out.latents.vision]"),
    (lambda t: t.__setitem__("out.latents.vision", t["out.latents.vision"][..., :2]), "entries[out.latents.vision].shape"),
    (lambda t: t.__setitem__("out.request.text_ids", t["out.request.text_ids"].to(torch.int32)),
     "entries[out.request.text_ids].dtype"),
    (lambda t: t.__setitem__("out.request.extra.0", t["out.request.extra.0"].t()), "entries[out.request.extra.0].shape"),
    (lambda t: t.__setitem__("stray", torch.zeros(1)), "entries"),
])
def test_check_names_the_field(damage, field):
    m, t = packed()
    damage(t)
    with pytest.raises(TransferError) as e:
        m.check(t)
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_manifest_validation():
    e = TensorEntry("a", (1,), "torch.float32", "contiguous", 4, 1)
    with pytest.raises(TransferError, match="^lifetime"):
        TransferManifest("r", "s", "p", "c", (e,), lifetime="forever")
    with pytest.raises(TransferError, match="^entries: duplicate"):
        TransferManifest("r", "s", "p", "c", (e, e))
    m = TransferManifest("r", "s", "p", "c", (e,))
    with pytest.raises(TransferError, match=r"^entries\[a\].chunks: declared 1, received 2"):
        m.check_chunks("a", 2)
    with pytest.raises(TransferError, match="^cache_key"):
        TransferManifest("r", "s", "p", "c", (e,), cache_key="k1").check_cache_entry(
            TransferManifest("r", "s", "p", "c", (e,), cache_key="k0"))


def test_content_key_sees_bytes_names_and_salt():
    a = {"x": torch.tensor([1.0, 2.0])}
    assert content_key(a, "v1") == content_key({"x": torch.tensor([1.0, 2.0])}, "v1")
    assert content_key(a, "v1") != content_key({"x": torch.tensor([1.0, 2.5])}, "v1")
    assert content_key(a, "v1") != content_key({"y": torch.tensor([1.0, 2.0])}, "v1")
    assert content_key(a, "v1") != content_key(a, "v2")


@pytest.mark.parametrize("make", [InProcessTransport, SharedMemoryTransport])
def test_transport_moves_bitwise_counts_bytes_and_consumes_once(make):
    tr = make(chunk_bytes=64)
    m, t = packed()
    h = tr.send(m, t)
    t["out.latents.vision"].zero_()                 # the producer reuses its buffer: the transfer holds a copy
    m2, got = tr.recv(h)
    _, want = packed()
    assert m2 == m and all(torch.equal(got[k], want[k]) for k in want)
    assert tr.bytes_moved == m.nbytes
    with pytest.raises(TransferError, match="^completion_event_id"):
        tr.recv(h)


def test_shared_memory_is_released_after_consumption():
    tr = SharedMemoryTransport(chunk_bytes=64)
    m, t = packed()
    h = tr.send(m, t)
    names = [seg for _, made in h.segments for seg, _ in made]
    assert len(names) == sum(e.chunks for e in m.entries) and all(segment_exists(n) for n in names)
    tr.recv(h)
    assert not any(segment_exists(n) for n in names) and tr.live_segments() == set()
    # a receive that fails its check still frees every segment
    h = tr.send(m, t)
    names = [seg for _, made in h.segments for seg, _ in made]
    bad = type(h)(h.manifest, tuple((n, made[:-1]) if n == "out.latents.vision" else (n, made)
                                    for n, made in h.segments))
    with pytest.raises(TransferError, match=r"^entries\[out.latents.vision\].chunks"):
        tr.recv(bad)
    lost = h.segments[[n for n, _ in h.segments].index("out.latents.vision")][1][-1][0]
    assert [n for n in names if segment_exists(n)] == [lost]   # every segment the handle named is freed
    assert tr.live_segments() == {lost}                         # the producer still sees the one the handle lost
    release(h)
    assert not any(segment_exists(n) for n in names) and tr.live_segments() == set()


def _consume(handle, q):
    tr = SharedMemoryTransport(chunk_bytes=64)
    _, t = tr.recv(handle)
    q.put({k: v.sum().item() for k, v in t.items()})


def test_shared_memory_across_processes_no_leak():
    tr = SharedMemoryTransport(chunk_bytes=64)
    m, t = packed()
    h = tr.send(m, t)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_consume, args=(h, q))
    p.start()
    sums = q.get(timeout=120)
    p.join(timeout=60)
    assert p.exitcode == 0
    assert sums == {k: v.sum().item() for k, v in t.items()}
    assert not any(segment_exists(seg) for _, made in h.segments for seg, _ in made)


def test_faulty_transport_is_caught_by_the_consumer():
    m, t = packed()
    tr = FaultyTransport(InProcessTransport(chunk_bytes=64), drop_last_chunk="*")
    with pytest.raises(TransferError, match=r"^entries\[out.latents.vision\].chunks: declared 5, received 4"):
        tr.recv(tr.send(m, t))
    tr = FaultyTransport(InProcessTransport(chunk_bytes=64), cast=("out.latents.vision", torch.bfloat16))
    with pytest.raises(TransferError, match=r"^entries\[out.latents.vision\].dtype: declared torch.float32"):
        tr.recv(tr.send(m, t))


def _dist_rank(rank, port, q):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tr = TorchDistTransport(peer=1 - rank, chunk_bytes=64)
        if rank == 0:
            m, t = packed()
            tr.send(m, t)
            q.put(("sent", tr.bytes_moved))
        else:
            m, t = tr.recv()
            _, want = packed()
            q.put(("recv", m == packed()[0] and all(torch.equal(t[k], want[k]) for k in want)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.dist
def test_torch_dist_gloo_moves_a_manifest_between_ranks():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_dist_rank, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {"sent": packed()[0].nbytes, "recv": True}
