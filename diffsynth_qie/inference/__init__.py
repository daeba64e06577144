"""Inference: the ``Editor`` API, flow-matching and LBM bridge samplers, mask blending.

``Editor`` is the one entry point the CLI (``qie edit``), training validation, the UI
and benchmarks share; the sampling loops live one layer down in ``models.sampling``
(training's validation runs them too) and are re-exported here; ``masking`` holds the
mask semantics.
"""
from .editor import EditRequest, EditResult, Editor, parse_device_map, parse_dtype
from ..models.samplers.sampling import (Conditioning, bridge_interpolate, bridge_sigmas, bridge_step, bridge_target,
                               dit_velocity, predict_velocity, sample_bridge, sample_flow_match)

__all__ = [
    "EditRequest", "EditResult", "Editor", "parse_device_map", "parse_dtype",
    "Conditioning", "bridge_interpolate", "bridge_sigmas", "bridge_step", "bridge_target",
    "dit_velocity", "predict_velocity", "sample_bridge", "sample_flow_match",
]
