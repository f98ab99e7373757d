"""attnx benchmarks: ``python -m benchmarks`` (``make bench``); every figure is a ratio taken in one run."""
