"""LLM Inspector's inference engine: a hand-written Llama-family forward with named hooks on every stage.

The core is this folder's modules: config, errors, loader (with sources, weights, gguf_import,
gguf_tokenizer), model, kv_cache, rope, tokenizer, sampling, settings, generate, progress, heap, and the
native accelerator (engine.native). The core imports engine.inspection (the probe its hooks offer stages to,
the run record) and nothing else of the engine: no tool (engine.tools), no report (engine.report), no bench
(engine.bench), no CLI (engine.cli). Tools build on the core's public API only."""
import engine.threads  # noqa: F401,I001  (first: the thread policy, before torch loads libgomp)
from engine.errors import EngineError, InputError, ModelLoadError, UnsupportedModelError
from engine.generate import GenerationRun, generate
from engine.inspection.interventions import HookContext, plant, scale, zero_heads
from engine.inspection.probe import Probe, inspection_probe
from engine.inspection.recording import Capture, Recording
from engine.inspection.stat_columns import STAT_NAMES
from engine.inspection.stats import StatRecord, StatsBlock
from engine.inspection.trace import Trace, load_trace, make_trace, save_trace
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.model import Model
from engine.results import Candidate, GenerationResult, Step
from engine.sampling import SamplingParams
from engine.settings import RunSettings

__all__ = [
    "EngineError", "InputError", "ModelLoadError", "UnsupportedModelError", "Candidate", "GenerationResult",
    "GenerationRun", "Step", "generate", "KVCache", "load_model", "Model", "Capture", "Recording", "HookContext",
    "Probe", "plant", "scale", "zero_heads", "inspection_probe", "SamplingParams", "RunSettings", "STAT_NAMES",
    "StatRecord", "StatsBlock", "Trace", "load_trace", "make_trace", "save_trace",
]
