"""The embedded sample world: synthetic coloured shapes in the benchmarks' real formats (DESIGN.md section 8)."""
from .world import WorldConfig, generate_world

__all__ = ["WorldConfig", "generate_world"]
