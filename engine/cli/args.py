"""Argument builders every command shares, and what they turn into: a loaded model, one SamplingParams,
one RunSettings. Subcommand modules take this module as `common`."""
from __future__ import annotations

import argparse
from dataclasses import fields

from engine.cli.progress_line import progress_printer
from engine.loader import QUANT_MODES, load_model
from engine.sampling import SamplingParams
from engine.settings import RunSettings

# flag -> (SamplingParams field, type, default, help); the one list the CLI builds sampler settings from
SAMPLER_FLAGS = {
    "--temperature": ("temperature", float, "0 = greedy"),
    "--top-k": ("top_k", int, "0 = off"),
    "--top-p": ("top_p", float, "1 = off"),
    "--min-p": ("min_p", float, "0 = off"),
    "--repetition-penalty": ("repetition_penalty", float, "1 = off"),
    "--frequency-penalty": ("frequency_penalty", float, "0 = off"),
    "--presence-penalty": ("presence_penalty", float, "0 = off"),
    "--no-repeat-ngram": ("no_repeat_ngram", int, "0 = off"),
}
assert {f for f, _, _ in SAMPLER_FLAGS.values()} == {f.name for f in fields(SamplingParams)}


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory, .gguf file or org/name (default: bundled SmolLM2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--quant", default="dequantized", choices=QUANT_MODES,
                   help="a GGUF model's weights: dequantized (imported as floats, the default), stored (its "
                        "matrices kept in the file's quantised blocks, multiplied exactly with x in float32; CPU "
                        "float32) or stored-int8 (the same blocks, llama.cpp's arithmetic: x rounded to 8 bits, "
                        "integer dot products, for Q4_K, Q8_0 and Q4_1)")


def prompt_args(p: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """The prompt (optional where another flag can bring the run, e.g. report --from-trace) and its format."""
    p.add_argument("prompt", **({"nargs": "?", "default": None} if optional else {}))
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--allow-special", action="store_true",
                   help="let special-token text in the prompt act as control tokens")


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    defaults = SamplingParams()
    for flag, (name, kind, help_) in SAMPLER_FLAGS.items():
        p.add_argument(flag, type=kind, default=getattr(defaults, name), help=help_)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    """The sampler settings of the parsed flags (InputError names a bad one)."""
    return SamplingParams(**{name: getattr(a, name) for name, _, _ in SAMPLER_FLAGS.values()})


def run_settings(a: argparse.Namespace, **extra) -> RunSettings:
    """The run the flags describe, as the app would store it."""
    return RunSettings(prompt=a.prompt, chat=a.chat, system=a.system, allow_special=a.allow_special,
                       max_new_tokens=a.max_new_tokens, params=sampling_params(a), seed=a.seed,
                       stop=tuple(a.stop), **extra)


def load(a: argparse.Namespace):
    return load_model(a.model, device=a.device, dtype=a.dtype, progress=progress_printer(),
                      quant=getattr(a, "quant", "dequantized"))
