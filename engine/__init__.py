"""LLM Inspector's inference engine: a hand-written Llama-family forward with named hooks on every stage."""
from .errors import EngineError, InputError, ModelLoadError, UnsupportedModelError
from .generate import Candidate, GenerationResult, GenerationRun, Step, generate
from .kv_cache import KVCache
from .loader import load_model
from .model import Model
from .probe import Capture, HookContext, Probe, inspection_probe, plant, scale, zero_heads
from .sampling import SamplingParams
from .settings import RunSettings
from .stats import STAT_NAMES, StatRecord, StatsBlock
from .trace import Trace, load_trace, make_trace, save_trace

__all__ = [
    "EngineError", "InputError", "ModelLoadError", "UnsupportedModelError", "Candidate", "GenerationResult",
    "GenerationRun", "Step", "generate", "KVCache", "load_model", "Model", "Capture", "HookContext", "Probe",
    "plant", "scale", "zero_heads", "inspection_probe", "SamplingParams", "RunSettings", "STAT_NAMES",
    "StatRecord", "StatsBlock", "Trace", "load_trace", "make_trace", "save_trace",
]
