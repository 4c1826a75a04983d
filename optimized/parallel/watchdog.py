"""Which peer broke a collective: heartbeats, progress and exits of every rank in the rendezvous store.

gloo / NCCL report a dead or stuck peer as a timeout or a closed connection on the rank that waits, without saying
which peer. Each rank therefore writes (in a daemon thread) a heartbeat every `interval_s`, announces each
collective before entering it (`enter`), and records how it ended (`mark_exit`). When a collective fails, the
waiting rank's `diagnose()` reads the others' records and names the rank that exited, went silent or fell behind.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist


class Watchdog:
    def __init__(self, store, rank: int, world_size: int, interval_s: float = 1.0, prefix: str = "fvwd"):
        self.store = dist.PrefixStore(prefix, store)
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.seq, self.what = 0, "start"
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._loop, name=f"fv-watchdog-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def from_default_group(cls, interval_s: float = 1.0) -> "Watchdog | None":
        """On the default process group's store (None when there is no group or no store)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()   # the rendezvous TCPStore (torchrun's agent or tcp://)
        except Exception:  # noqa: BLE001 - a backend without a store: no diagnosis, collectives still time out
            return None
        return cls(store, dist.get_rank(), dist.get_world_size(), interval_s)

    def _beat(self) -> None:
        self.store.set(f"hb/{self.rank}", f"{time.time():.3f}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store's host is gone: the collectives will say so
                return

    def enter(self, what: str) -> None:
        self.seq += 1
        self.what = what
        try:
            self.store.set(f"seq/{self.rank}", f"{self.seq}|{what}")
        except Exception:  # noqa: BLE001
            pass

    def mark_exit(self, status: str) -> None:
        """Record how this rank ended ("ok", "error: ...", "exited early") and stop beating."""
        self._stop.set()
        try:
            self.store.set(f"exit/{self.rank}", status)
        except Exception:  # noqa: BLE001
            pass

    def _read(self, key: str) -> str | None:
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def diagnose(self, stale_s: float | None = None) -> str:
        """One sentence naming the peers that exited, stopped beating or are behind this rank."""
        stale_s = stale_s if stale_s is not None else max(5.0, 5 * self.interval_s)
        found = []
        try:
            # two heartbeat samples 2 intervals apart: a peer that just died still has a fresh last beat
            first = {r: self._read(f"hb/{r}") for r in range(self.world_size) if r != self.rank}
            time.sleep(2.5 * self.interval_s)
            now = time.time()
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                ended = self._read(f"exit/{r}")
                if ended is not None:
                    found.append(f"rank {r} ended ({ended})")
                    continue
                hb = self._read(f"hb/{r}")
                if hb is None:
                    found.append(f"rank {r} never started")
                    continue
                age = now - float(hb)
                if hb == first.get(r) and self._read(f"exit/{r}") is None:
                    found.append(f"rank {r} died or froze (no heartbeat for {age:.0f} s, no exit recorded)")
                    continue
                if age > stale_s:
                    found.append(f"rank {r} stopped responding (last heartbeat {age:.0f} s ago)")
                    continue
                seq = self._read(f"seq/{r}")
                n, what = (int(seq.split("|", 1)[0]), seq.split("|", 1)[1]) if seq else (0, "start")
                if n < self.seq:
                    found.append(f"rank {r} is alive but behind: at collective #{n} ({what}) while rank "
                                 f"{self.rank} waits in #{self.seq} ({self.what})")
        except Exception as e:  # noqa: BLE001 - the store died with its host
            return f"the rendezvous store is unreachable ({type(e).__name__}); its host rank or agent died"
        return "; ".join(found) if found else "no peer failure recorded (a slow peer or a timeout set too low)"

    def close(self) -> None:
        self._stop.set()
