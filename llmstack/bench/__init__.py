"""Benchmarks: measurements that print figures (thin entry points in benchmarks/)."""
