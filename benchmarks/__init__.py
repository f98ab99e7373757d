"""attnx benchmarks: ``python -m benchmarks`` (or ``make bench``). Every figure is a ratio measured in one run."""
