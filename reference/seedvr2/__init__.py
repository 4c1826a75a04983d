"""seedvr2 reference: NaDiT (3B dit_v2 / 7B dit), window partitions, video VAE, one-step restoration sampler."""

from reference.seedvr2.nadit import NaDiT, load_nadit
from reference.seedvr2.windows import regular_cuts, shifted_cuts, window_size, windows

__all__ = ["NaDiT", "load_nadit", "regular_cuts", "shifted_cuts", "window_size", "windows"]
