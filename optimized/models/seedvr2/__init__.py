"""seedvr2 optimized path: fast NaDiT with window-aligned SP (Plan A), window geometry + plan cache, model spec."""

from optimized.models.seedvr2.model import FastNaDiT, Faults, load_fast_nadit
from optimized.models.seedvr2.spec import nadit_component, seedvr2_model_spec, validate_parallel_plan
from optimized.models.seedvr2.windows import PlanCache, build_geometry, make_plan

__all__ = ["FastNaDiT", "Faults", "PlanCache", "build_geometry", "load_fast_nadit", "make_plan", "nadit_component",
           "seedvr2_model_spec", "validate_parallel_plan"]
