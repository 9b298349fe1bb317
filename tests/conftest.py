"""Test-wide settings."""
import os

# Before torch loads: idle OpenMP threads sleep instead of spinning (2 shared cores; see stages/_common.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
