"""Benchmarks (``make bench``): run from the repository root on a GPU machine,
``python -m benchmarks.bench_all [OUT_DIR]``.  Not installed with the package."""
