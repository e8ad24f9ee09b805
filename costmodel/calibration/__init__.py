"""Calibration: fit a device's and a cluster's profile to measurements.

Microbenchmarks of ops, collectives and compiled chains (`microbench`, `microbench_comm`,
`microbench_compile`) feed the fits of `soap calibrate --device` (`calibrate`, `device`, `cluster`,
`node`, `fit`, `predict`, `suite`); `runs` refits a profile from logged training runs. It writes profile
files; it may import `tracer` and the rest of `costmodel`, never `planner` or `executor`.
"""
