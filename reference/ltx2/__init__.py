"""ltx2 reference: the readable single-device LTX2VideoTransformer3DModel (the oracle)."""

from reference.ltx2.model import Ltx2Model, load_model

__all__ = ["Ltx2Model", "load_model"]
