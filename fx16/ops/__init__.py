"""The op tables and numerics: what each ATen op is, computes and costs, and 16-bit's limits."""
