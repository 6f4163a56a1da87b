"""The public surface under its first name: ``needle_wgpu.engine.Needle3`` is ``api.Model``."""

from .api import GenerationResult, Model, Needle3, TokenEvent

__all__ = ["GenerationResult", "Model", "Needle3", "TokenEvent"]
