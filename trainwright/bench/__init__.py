"""Side-by-side benchmarks behind ``trainwright bench NAME``."""
