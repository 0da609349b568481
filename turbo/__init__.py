"""turbo: the inference engine (paged KV cache, stateful sessions, W4A16 kernels through ``backends``)."""
from .config import EngineConfig, GenerationConfig
from .engine import Engine, GenerationOutput
from .session import Session

__all__ = ["Engine", "EngineConfig", "GenerationConfig", "GenerationOutput", "Session"]
