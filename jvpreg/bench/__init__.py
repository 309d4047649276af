"""Benchmarks (scripts, not tests): ``python -m jvpreg.bench {jvp,train,paper,spectral,operators} --help``."""
