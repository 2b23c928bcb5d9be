"""The machinery of benchmarks/gpu_suite.py (core, env, report) and its parts (parts, extract);
args: the list options of every benchmark script, checked."""
