"""hybridmoe: Mixture-of-Experts inference for models larger than the accelerator."""

__version__ = "0.1.0"
