"""Goodput sweeps: start a deployment (collocated or prefill/decode disaggregated), offer it
requests at a series of rates with benchmarks.serve, and find the highest rate at which the share
of requests meeting a TTFT and a TPOT/ITL SLO stays above a target. `python -m benchmarks.goodput`.
"""
