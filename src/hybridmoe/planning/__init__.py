"""Planning before loading: routing traces, a cache simulator (with Belady's bound), a hardware
cost model and a planner that predicts decode tok/s from a model's config.

Layering: above models/ (the trace recorder wraps MoE layers' expert backends), below
engine/ (the command that drives an engine to record a trace lives in cli_planning.py).
"""
