"""Benchmarks (``torchparity bench``): settings, the rounds, one module per part, and the runner."""
