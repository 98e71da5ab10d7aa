"""Triton kernel families (one file a family); compiled per target by m3c.backends."""
