"""Benchmarks (GPU measurements and throughput scripts)."""
