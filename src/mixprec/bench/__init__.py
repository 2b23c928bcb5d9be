"""Benchmark workloads and tooling. An application of the library, not part of its API."""
