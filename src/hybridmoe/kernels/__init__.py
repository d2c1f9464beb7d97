"""Fast CPU kernels (numba), each checked against its torch reference in moe/cpu_experts.py."""
