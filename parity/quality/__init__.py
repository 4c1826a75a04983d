"""Quality metrics for accelerations on a TRAINED model (issue 21): the procedural "moving shapes" video set and its
caption grammar (`shapes`), a closed-form prompt-adherence evaluator (`adherence`), PSNR / SSIM against the exact run
(`image`), a distribution test of an accelerated path against the exact path with its detectable effect size
(`distribution`, the C3 machinery of `parity.rollout_checks`), and the contract's request set `HELD_OUT`."""

from parity.quality.adherence import (
                                   AdherenceScore,
                                   AttributeVerdict,
                                   adherence_rate,
                                   score_clip,
)
from parity.quality.distribution import DistributionResult, distribution_test
from parity.quality.evaluate import (
                                   AdherenceReport,
                                   autoencoder_ceiling,
                                   engine_clip,
                                   held_out_adherence,
)
from parity.quality.image import ImageQuality, psnr, ssim, video_quality
from parity.quality.shapes import (
                                   COLOURS,
                                   DIRECTIONS,
                                   HELD_OUT,
                                   SHAPES,
                                   SPEEDS,
                                   Caption,
                                   HeldOutRequest,
                                   all_captions,
                                   parse_caption,
                                   render_clip,
                                   training_captions,
)

__all__ = [
                                   "COLOURS",
                                   "DIRECTIONS",
                                   "HELD_OUT",
                                   "SHAPES",
                                   "SPEEDS",
                                   "AdherenceReport",
                                   "AdherenceScore",
                                   "AttributeVerdict",
                                   "Caption",
                                   "DistributionResult",
                                   "HeldOutRequest",
                                   "ImageQuality",
                                   "adherence_rate",
                                   "all_captions",
                                   "autoencoder_ceiling",
                                   "distribution_test",
                                   "engine_clip",
                                   "held_out_adherence",
                                   "parse_caption",
                                   "psnr",
                                   "render_clip",
                                   "score_clip",
                                   "ssim",
                                   "training_captions",
                                   "video_quality",
]
