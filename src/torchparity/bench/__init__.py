"""Benchmarks: the runner (:mod:`.runner`), one worker process per backend, and the report."""
