"""How the tools print sizes (`clipfinetune plan`, `clipfinetune data`)."""
from __future__ import annotations


def fmt_bytes(n: float | None, unknown: str = "-") -> str:
    """Decimal units, as the sources state their sizes (19.3 GB); `unknown` for None."""
    if n is None:
        return unknown
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
