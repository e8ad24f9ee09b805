"""Validation: compare soap's predictions with runs, and refit from them.

`validate` and `suite` run the executor on a suite of plans and compare measured with predicted
(`metrics`, `plot`, `run`); `refit` calibrates a profile from those runs; `run_records` and `external`
read runs from outside soap (published tables, a user's logs) and fit a profile to them. It is a stage
of its own on top of the executor: it may import `tracer`, `costmodel`, `planner` and `executor`;
the modules that realize a plan never import it.
"""
