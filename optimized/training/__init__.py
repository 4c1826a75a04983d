"""The training plane: rollout = the serving loop + capture (BehaviorRecords), logprob recompute, weight sync.

    records     CaptureSpec, BehaviorRecord (save / load), the per-request recorder the loops keep
    recompute   the trainer's recompute of a record's per-step logprobs with the engine (batch-invariant)
    rollout     group rollouts through the engine (K samples of one prompt as one batch)
    weights     the weight-update lifecycle behind `Engine.update_weights`
"""

from optimized.training.records import BehaviorRecord, CaptureSpec, RolloutStep

__all__ = ["BehaviorRecord", "CaptureSpec", "RolloutStep"]
