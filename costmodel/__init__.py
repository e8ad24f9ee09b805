"""Profiles, op/collective/memory costs, the strategy vocabulary and the simulator. Imports only tracer."""
