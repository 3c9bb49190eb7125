"""Micro-benchmarks, one component each; run as `python -m benchmarks.micro.<name> --help`."""
