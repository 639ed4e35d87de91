"""load_model: resolve a source, read config, weights and tokenizer, return a shareable Model."""
from __future__ import annotations

import os

import torch

from engine.config import ModelConfig
from engine.errors import EngineError, ModelLoadError
from engine.gguf_import import Progress
from engine.gguf_stored import stored_weights
from engine.memory import check_fits, check_fits_bytes
from engine.model import Model
from engine.sources import BUNDLED_NAME, gguf_path_of, resolve, stored_dir
from engine.weights import load_weights

# A GGUF file's weights: every tensor imported as float, or its matrices kept in the file's blocks (engine.gguf_stored)
# and multiplied in one of two arithmetics (engine.quant_int8.ARITHMETICS): the one place a mode names its arithmetic.
STORED = {"stored": "float", "stored-int8": "int8"}
QUANT_MODES = ("dequantized", *STORED)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise EngineError(f"unsupported device {str(device)[:40]!r}; use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was asked for but no CUDA GPU is available")
    if dev.type not in ("cpu", "cuda"):
        raise EngineError(f"unsupported device {str(device)!r}; use cpu or cuda")
    return dev


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or str(dtype) == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise EngineError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in DTYPES:
        raise EngineError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return DTYPES[key]


def load_model(source: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, progress: Progress | None = None,
               quant: str = "dequantized") -> Model:
    """Load the bundled default (source=None), an HF directory, a .gguf file or an org/name from the hub cache.
    quant (GGUF sources): "dequantized", every tensor imported as float (dtype); "stored", the matrices in the
    formats engine.quant_matrix decodes kept in the file's blocks (engine.gguf_stored), the rest float32, on the CPU
    in float32, each product the file's exact weights times x in float32; "stored-int8", the same blocks multiplied
    in llama.cpp's arithmetic (x rounded to 8 bits once a product, integer dot products: engine.quant_int8) where the
    format has that kernel (Q4_K, Q8_0, Q4_1; the others keep the float one, said in model.weights.notes)."""
    from engine.tokenizer import Tokenizer

    if quant not in QUANT_MODES:
        raise EngineError(f"unsupported quant {str(quant)[:40]!r}; use {', '.join(QUANT_MODES)}")
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    gguf = gguf_path_of(source) if quant in STORED else None
    if quant in STORED:
        if gguf is None:
            raise EngineError(f"quant={quant!r} keeps a GGUF file's blocks; {str(source)[:80]!r} is not a .gguf file")
        if dev.type != "cpu" or dt != torch.float32:
            raise EngineError(f"quant={quant!r} runs on the CPU in float32 (its products decode blocks in the native "
                              f"kernel); got {dev.type} {str(dt).removeprefix('torch.')}")
    if gguf is None:
        model_dir, name = resolve(source, progress)
    else:       # config.json and the tokenizer only: no tensor is dequantised to disk
        model_dir = stored_dir(gguf)
        name = BUNDLED_NAME if source is None or str(source) in ("", "default", "bundled") else gguf.name
    cfg = ModelConfig.from_json(model_dir / "config.json")
    if gguf is None:
        check_fits(cfg, dt, str(model_dir))            # refused before a byte of the weights is read
    else:       # the blocks are held as the file holds them: at most its size (plus float norms)
        check_fits_bytes(gguf.stat().st_size, f"{gguf.name} (weights kept quantized)")
    if progress:
        progress(0.95, "loading weights")
    if gguf is None:
        weights = load_weights(model_dir, cfg, dev, dt, progress)
    else:
        weights = stored_weights(gguf, cfg, STORED[quant])
        name = f"{name} [weights kept quantized{', llama.cpp int8 products' if STORED[quant] == 'int8' else ''}]"
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
    except FileNotFoundError as e:
        raise ModelLoadError(str(e)) from None
    except Exception as e:  # tokenizers raises a bare Exception for a bad tokenizer.json, json a JSONDecodeError
        raise ModelLoadError(f"{model_dir}: cannot read the tokenizer (tokenizer.json, tokenizer_config.json): {e}"
                             ) from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{model_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                             f"vocabulary has {cfg.vocab_size}: they do not belong together")
    tokenizer.cover(cfg.vocab_size)      # a padded vocabulary: the ids past the tokenizer's are spelled as such
    model = Model(cfg, weights, tokenizer, device=dev, dtype=dt, name=name, path=model_dir, native_decode=True)
    if progress:
        progress(1.0, f"{name} ready on {dev.type} ({str(dt).removeprefix('torch.')})")
    return model
