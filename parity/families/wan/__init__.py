"""The wan parity family (Wan 2.1 / 2.2): one entry, assembled from one module per component or level.

Imports only go downward: common.py (models under test, tolerances, the two sides' adapters, traces, engine-side
decode) and faults.py (every planted fault) are used by the component modules dit.py (DiT, probe `wan.dit`),
umt5.py (text encoder, `wan.umt5`), vae.py (VAE, `wan.vae_encode` / `wan.vae_decode`), processors.py (prompt and
image processors, `wan.processor`), and by the level modules c0.py (every component, scheduler step, the loop's DiT
input), c1.py (denoise trajectories, `wan.generate`), c2.py (logprob identity of SDE rollouts), c3.py (rollout
distributions) and c4.py (decoded frames). This file wires levels, faults, probes and the fvconvert post-checks
into FAMILY.

fvconvert post-checks (pyproject `[project.entry-points."fvconvert.post_check"]`, named by each component
manifest's `parity.post_check`): `wan` (a converted VAE), `wan.transformer` (a converted DiT), `wan.text_encoder`
(a converted UMT5); each runs C0 (fp32, CPU) on the converted directory, whose manifest says which component it is.
"""

from __future__ import annotations

from pathlib import Path

from parity.checkpoints import c0_post_check
from parity.families.wan import c0, c1, c2, c3, c4, common, dit, faults, processors, umt5, vae
from parity.family import ParityFamily

LEVELS = {"C0": processors.with_processor_checks(c0.run_c0), "C1": c1.run_c1, "C2": c2.run_c2, "C3": c3.run_c3,
          "C4": c4.run_c4}
PROBES = {**vae.PROBES, **dit.PROBES, **umt5.PROBES, **c1.PROBES, **processors.PROBES}


def _post_check(out_dir: Path, kind: str) -> dict:
    from manifests.checkpoint import CheckpointError, read_checkpoint

    try:
        ckpt = read_checkpoint(out_dir, family="wan")
        got = "model" if ckpt.is_model else next(iter(ckpt.components.values())).kind
    except CheckpointError as e:
        return {"status": "error", "level": "C0", "detail": str(e)}
    if got != kind:
        return {"status": "error", "level": "C0", "detail": f"{out_dir} holds a wan {got}, not a {kind}"}
    return c0_post_check(c0.run_c0, out_dir)


def check_converted(out_dir) -> dict:
    """Entry point `wan`: C0 (fp32, CPU) on a freshly converted wan VAE."""
    return _post_check(Path(out_dir), "vae")


def check_converted_transformer(out_dir) -> dict:
    """Entry point `wan.transformer`: C0 of the DiT (fp32, CPU) on a freshly converted DiT."""
    return _post_check(Path(out_dir), "transformer")


def check_converted_text_encoder(out_dir) -> dict:
    """Entry point `wan.text_encoder`: C0 of UMT5 (fp32, CPU) on a freshly converted text encoder."""
    return _post_check(Path(out_dir), "text_encoder")


# entry point name (a component manifest's parity.post_check) -> check, beside the family's own `check_converted`
COMPONENT_POST_CHECKS = {"wan.transformer": check_converted_transformer,
                         "wan.text_encoder": check_converted_text_encoder}

FAMILY = ParityFamily(
    name="wan",
    description="Wan 2.1 / 2.2: DiT expert(s), UMT5 text encoder, denoise loop (UniPC / Euler, CFG, experts, i2v / "
                "ti2v conditioning), SDE rollouts, VAE decoder and encoder (chunked loops with carried conv caches)",
    levels=LEVELS, variants=common.variants, default_variants=common.DEFAULT_VARIANTS,
    faults=faults.FAULTS + c2.FAULTS + c3.FAULTS, golden_probes=PROBES, check_converted=check_converted,
    component_post_checks=COMPONENT_POST_CHECKS)
