"""Exceptions a user sees. Each message names the file, tensor, field or flag at fault."""


class HybridMoeError(Exception):
    """Base class of every error hybridmoe raises on purpose."""


class CheckpointError(HybridMoeError, ValueError):
    """A checkpoint directory is missing a file, or a file is corrupt or inconsistent."""


class UnsupportedConfigError(CheckpointError):
    """config.json asks for something this engine cannot run exactly."""


class CpuExpertError(HybridMoeError, RuntimeError):
    """The CPU worker failed while computing a layer's expert routes; the cause is chained."""


class PinnedMemoryError(HybridMoeError, RuntimeError):
    """The system refused to page-lock host memory for the expert banks."""


class DeviceMemoryError(HybridMoeError, ValueError):
    """What was asked for does not fit in the accelerator's memory budget."""


class HostMemoryError(HybridMoeError, ValueError):
    """What was asked for does not fit in the host's available memory."""
