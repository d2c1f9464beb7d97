"""hybridmoe: Mixture-of-Experts inference for models larger than the accelerator."""

__version__ = "0.1.0"

from hybridmoe import env as _env

# torch's libgomp is the process's one OpenMP runtime: numba's OpenMP layer binds to it too
# (the dynamic loader reuses the loaded libgomp.so.1). It reads its wait policy once, when
# torch loads, and by default spins each pool thread for ~3 ms after every parallel region: on
# a CPU decode step's dozens of short kernel launches that keeps a core spinning, which the
# numba kernels and other processes need (kernels/numba_moe.py). Passive unless the user set
# OMP_WAIT_POLICY (or GOMP_SPINCOUNT, which libgomp lets override it); restored after, so
# child processes' torch is unaffected. No effect when torch was imported before hybridmoe.
with _env.passive_openmp():
    import torch  # noqa: F401, E402
