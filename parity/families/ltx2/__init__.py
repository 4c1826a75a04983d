"""ltx2 parity: C0 (the full forward, reference vs optimized, first divergent layer named, and the media components),
C1 (the LTX2Pipeline loop, parity/families/ltx2/c1.py), C2 (logprob identity of SDE rollouts of both loops, c2.py),
C3 (rollout distributions per modality, c3.py), C4 (decoded frames + waveform end to end, c4.py), planted faults,
the golden probe `ltx2.forward` (cases written by `fvparity align ltx2 --save`), the fvconvert
post-check, and what `fvparity align` reads (`SIDES`)."""

from __future__ import annotations

import optimized.models.ltx2 as opt
import reference.ltx2 as ref
from manifests.ltx2 import key_shapes, list_variants, load_variant
from manifests.ltx2.keys import GAINS
from parity.families.ltx2.c1 import FAULTS as C1_FAULTS
from parity.families.ltx2.c1 import run_c1
from parity.families.ltx2.c2 import FAULTS as C2_FAULTS
from parity.families.ltx2.c2 import run_c2
from parity.families.ltx2.c3 import FAULTS as C3_FAULTS
from parity.families.ltx2.c3 import run_c3
from parity.families.ltx2.c4 import FAULTS as C4_FAULTS
from parity.families.ltx2.c4 import run_c4
from parity.families.ltx2.inputs import make_inputs
from parity.families.ltx2.media import (
    MEDIA_FAULTS,
    audio_vae_probe,
    run_media_c0,
    video_vae_probe,
    vocoder_probe,
)
from parity.families.ltx2.pipeline_golden import pipeline_probe
from parity.families.ltx2.post_checks import COMPONENT_POST_CHECKS
from parity.family import Fault, ParityFamily
from parity.port.kit import PortedSides

SIDES = PortedSides(family="ltx2", load_variant=load_variant, key_shapes=key_shapes, gains=GAINS,
                    make_inputs=make_inputs, reference=ref.load_model, optimized=opt.load_model,
                    default_variants=("tiny", "tiny-split", "tiny-2.3", "tiny-2.5"), fault_key="transformer_blocks.1.scale_shift_table", fault_layer="transformer_blocks.1",
                    # one negative control per stream and one across them: the audio head, audio feed-forward,
                    # the audio -> video attention
                    extra_faults=(("audio_proj_out.weight", "audio_proj_out"),
                                  ("transformer_blocks.0.audio_ff.net.2.weight", "transformer_blocks.0.audio_ff"),
                                  ("transformer_blocks.1.audio_to_video_attn.to_v.weight",
                                   "transformer_blocks.1.audio_to_video_attn")))


def run_c0(variants, checkpoint, device, dtypes, seed, fault, progress, **kw):
    """Transformer C0, plus the media components' C0 (ltxmedia's parity/families/ltx2/media.py) on a default run;
    a media fault is planted in the media run alone."""
    if fault is not None and fault in MEDIA_FAULTS:
        return run_media_c0(None, None, device, dtypes, seed, fault, progress)
    report = SIDES.run_c0(variants, checkpoint, device, dtypes, seed, fault, progress, **kw)
    if checkpoint is None and not variants:
        report.checks += run_media_c0(None, None, device, dtypes, seed, None, progress).checks
    return report


def check_converted(out_dir) -> dict:
    """fvconvert's post-check: C0 on the converted weights."""
    return SIDES.check_converted(out_dir)


FAMILY = ParityFamily(
    name="ltx2",
    description="LTX2VideoTransformer3DModel (diffusers:LTX2VideoTransformer3DModel), ported with fvparity port new",
    levels={"C0": run_c0, "C1": run_c1, "C2": run_c2, "C3": run_c3, "C4": run_c4}, variants=list_variants, default_variants=SIDES.default_variants,
    faults=tuple(Fault(name, f"{key} scaled on the optimized side", "C0", layer)
                 for name, (key, layer) in SIDES.faults.items())
    + tuple(Fault(name, f"{key} scaled on the optimized side", "C0", layer)
            for name, (_, key, layer) in MEDIA_FAULTS.items())
    + tuple(Fault(name, "the optimized LTX2Pipeline loop planted with " + name[3:].replace("-", " "), "C1", step)
            for name, step in C1_FAULTS.items())
    + C2_FAULTS + C3_FAULTS + C4_FAULTS,
    golden_probes={"ltx2.forward": SIDES.golden_probe(), "ltx2.pipeline": pipeline_probe,
                   "ltx2.video_vae": video_vae_probe, "ltx2.audio_vae": audio_vae_probe,
                   "ltx2.vocoder": vocoder_probe}, check_converted=check_converted,
    component_post_checks=COMPONENT_POST_CHECKS)
