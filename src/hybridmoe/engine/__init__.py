from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.engine import Engine
from hybridmoe.engine.sampling import SamplingParams
from hybridmoe.engine.sequence import Completion

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams"]
