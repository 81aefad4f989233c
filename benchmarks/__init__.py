"""Speed measurements; run each as `python -m benchmarks.<name>` (see its docstring)."""
