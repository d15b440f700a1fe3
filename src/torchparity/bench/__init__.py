"""Benchmarks (``torchparity bench``): the settings and the rounds every part measures in, one
module per part (throughput, diagnose_cost, decode_cost, check_time, user_model, at_size), and
the runner that calls them in turn."""
