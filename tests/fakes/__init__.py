"""Fake machines for check_gpu.py tests: a pynvml module built from a description, and the machines described."""
