"""python -m engine bench --sizes: what models of the sizes people run cost here (issue 44): models of public
configs' shapes with random weights, each opened in a fresh process per dtype, reporting the bytes held after
loading and after a first decode over the weights' bytes in that dtype, decode tokens/s over the memory floor of
that dtype (the bytes a token reads over this machine's read speed, measured in the same process), and transformers'
`generate` in the same dtype, in a process of its own, as the peer, and the app's inspected decode (statistics of
every stage, the logits, per-layer timing: engine.inspection.probe.inspection_probe) over the plain one.

The weights are written once per shape into the bench's folder ($LLM_INSPECTOR_CACHE/bench-sizes), every tensor the
engine expects for the config (engine.weights.expected_tensors), random normal scaled by 1/sqrt(fan-in) so that
activations stay finite, in float32 (one file; a bf16 run converts at load). The tokenizer is the bundled model's
(its 49,152 tokens fit inside each vocabulary; the bench feeds token ids). Each public shape is also written as a
GGUF file in Q8_0 and in Q4_K (engine.bench.size_files: llama.cpp's names and metadata, random valid blocks, one
tensor at a time), and so is a Llama-3.1-8B-shaped Q4_K file; they and the bundled model's own Q4_1 file are opened
in each load mode of QUANTS: dequantised to float32 (an import: the 8B file is refused before loading for its size,
engine.memory) and as stored (its matrices kept in their blocks, engine.gguf_stored). Entries are named
"<shape>-<format>" (qwen3-0.6b-q8_0, llama-3.1-8b-q4_k, smollm2-135m-q4_1) for --size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.bench.size_files import FORMATS, write_gguf
from engine.sources import bundled_gguf

SHAPES = {   # the public config.json of each model, the fields the engine reads (bos/eos set inside the tokenizer's)
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
                   "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": True,
                   "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    "llama-3.2-1b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5,
                     "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                     "hidden_act": "silu", "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                                            "low_freq_factor": 1.0, "rope_type": "llama3",
                                                            "original_max_position_embeddings": 8192}},
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
                   "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000, "rope_local_base_freq": 10000, "max_position_embeddings": 32768,
                   "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                   "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
}
DTYPES = ("float32", "bfloat16")
PROMPT, NEW = 32, 16          # a run's prompt and decoded tokens in each process
GGUF_SHAPES = {   # shapes written as GGUF files only (the 8B's float32 would not fit this machine's memory)
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu"},
}
# The GGUF entries: --size name -> (shape, format); (None, _): the bundled model's own file
GGUF_ENTRIES = {f"{shape}-{fmt.lower()}": (shape, fmt) for shape in SHAPES for fmt in FORMATS} | {
    "llama-3.1-8b-q4_k": ("llama-3.1-8b", "Q4_K"), "smollm2-135m-q4_1": (None, "Q4_1")}
# How each GGUF entry is loaded (engine.loader.load_model's quant -> its rows' label): one row per mode, in this order
QUANTS = {"dequantized": "dequantised float32", "stored": "as stored", "stored-int8": "as stored, int8 products"}


def folder() -> Path:
    root = os.environ.get("LLM_INSPECTOR_CACHE") or Path.home() / ".cache" / "llm-inspector"
    return Path(root) / "bench-sizes"


def make_model(name: str, raw: dict, out: Path) -> Path:
    """The model folder of this shape (written once: config.json, model.safetensors, the bundled tokenizer)."""
    from safetensors.torch import save_file

    from engine.config import ModelConfig
    from engine.gguf_file import open_gguf
    from engine.gguf_tokenizer import write_tokenizer_dir
    from engine.sources import bundled_gguf
    from engine.weights import expected_tensors
    path = out / name
    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    raw = {**raw, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for n, shape in expected_tensors(ModelConfig.from_dict(raw, where=name)).items():
        t = torch.randn(*shape, generator=g) * (shape[-1] ** -0.5 if len(shape) == 2 else 0.1)
        tensors[n] = t + 1.0 if n.endswith("norm.weight") and raw["model_type"] != "gemma3_text" else t
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    write_tokenizer_dir(open_gguf(bundled_gguf()), path)
    return path


def make_q4k_gguf(out: Path) -> Path:
    """The Llama-3.1-8B-shaped GGUF, every matrix in Q4_K (embedding and output too), written tensor by tensor from
    random block bytes whose fp16 scales (d, dmin) are set small and finite: never 32 GB of float32."""
    return write_gguf("llama-3.1-8b", GGUF_SHAPES["llama-3.1-8b"], "Q4_K", out)


def gguf_entry(name: str) -> Path:
    """The file of a GGUF entry (GGUF_ENTRIES), written once into the bench's folder."""
    shape, fmt = GGUF_ENTRIES[name]
    if shape is None:
        return bundled_gguf()
    return write_gguf(shape, {**SHAPES, **GGUF_SHAPES}[shape], fmt, folder())


READS = 4       # large reads after each pair of decodes, the best of all kept: the first read after a decode
                # measured 7-12 GB/s where the next ones read 23-29 (the step's threads still winding down)


def probe(path: str, dtype: str, quant: str = "dequantized") -> dict:
    """In a fresh process: load (a GGUF file dequantised, or its matrices kept as stored: engine.gguf_stored), held
    figures, decode speed over the floor of what it holds (engine.bench.held / speed)."""
    from engine import load_model
    from engine.bench.held import held_figures
    from engine.bench.speed import ReadBandwidth, bytes_per_decoded_token
    from engine.errors import ModelLoadError
    from engine.inspection.probe import inspection_probe
    from engine.memory import process_rss
    before = process_rss()
    try:
        model = load_model(path, device="cpu", dtype=dtype, quant=quant)
    except ModelLoadError as e:
        return {"refused": str(e).replace(str(Path(path).parent), "…")}
    out = held_figures(model, before)
    read = ReadBandwidth(model.device)
    plain, inspected = [], []
    for _ in range(3):        # plain and inspected decodes in turn, large reads after each pair
        plain += _decode(model, None)
        inspected += _decode(model, inspection_probe())
        for _ in range(READS):
            read.measure()
    tok_s = 1 / _median(plain)
    floor = read.bytes_per_second / bytes_per_decoded_token(model, PROMPT + NEW / 2)
    return {**out, "decode_path": "native" if model.accelerator.decode is not None else "PyTorch: "
            + model.accelerator.why_not, "decode_tok_s": tok_s, "floor_tok_s": floor,
            "decode_over_floor": tok_s / floor, "read_gb_s": read.bytes_per_second / 1e9,
            "inspected_over_plain_decode": _median(inspected) / _median(plain),
            "load_average_1m": os.getloadavg()[0]}   # the machine is shared: its load beside each figure


def _decode(model, probe) -> list[float]:
    """The seconds of each of NEW decode steps after a PROMPT-token prefill (probe: None, or the app's own)."""
    cache, steps = model.new_cache(PROMPT + NEW), []
    logits = model.forward(torch.arange(100, 100 + PROMPT), cache, probe, last_only=True)
    for _ in range(NEW):
        t0 = time.perf_counter()
        logits = model.forward(logits[-1:].argmax(-1), cache, probe)
        steps.append(time.perf_counter() - t0)
    return steps


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def peer(path: str, dtype: str) -> dict:
    """In a fresh process: transformers' generate of the same folder in the same dtype (decode tokens/s)."""
    try:
        import transformers
    except ImportError:
        return {"peer": "transformers not installed"}
    from engine.bench.speed import hf_speed
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                           attn_implementation="sdpa").eval()
    ids = list(range(100, 100 + PROMPT))
    hf_speed(hf, ids, 4, "cpu")
    return {"peer_decode_tok_s": max(hf_speed(hf, ids, NEW, "cpu")[1] for _ in range(2))}


def _child(fn: str, path: Path, dtype: str, *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "engine.bench.sizes", fn, str(path), dtype, *extra],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {f"{fn}_failed": out.stderr.strip().splitlines()[-1][:300] if out.stderr.strip() else "no output"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def sizes_bench(names: tuple[str, ...] = (*SHAPES, *GGUF_ENTRIES), dtypes: tuple[str, ...] = DTYPES, say=print,
                shapes: dict | None = None) -> dict:
    """Each named shape x dtype, figures keyed "<shape> <dtype>"; each named GGUF entry x load mode (QUANTS), keyed
    "<entry> <mode's label>"."""
    shapes = shapes or SHAPES
    out, root = {}, folder()
    for name in (n for n in names if n in shapes):
        say(f"{name}: writing its weights (once)")
        path = make_model(name, shapes[name], root)
        for dtype in dtypes:
            r = _child("probe", path, dtype)
            if "refused" not in r:
                r |= _child("peer", path, dtype)
                if "peer_decode_tok_s" in r and "decode_tok_s" in r:
                    r["over_peer_decode"] = r["decode_tok_s"] / r["peer_decode_tok_s"]
            out[f"{name} {dtype}"] = r
            say(line(f"{name} {dtype}", r))
    for name in (n for n in names if n in GGUF_ENTRIES):
        say(f"{name}: writing its GGUF file (once)")
        path = gguf_entry(name)
        for quant, label in QUANTS.items():
            key = f"{name} {label}"
            out[key] = _child("probe", path, "float32", quant)
            say(line(key, out[key]))
    return out


def line(key: str, r: dict) -> str:
    if "refused" in r:
        return f"{key:22s} refused: {r['refused']}"
    if "decode_tok_s" not in r:
        return f"{key:22s} {r}"
    peer_text = (f"{r['over_peer_decode']:.2f}x transformers ({r['peer_decode_tok_s']:.2f} tok/s)"
                 if "over_peer_decode" in r else next((v for k, v in r.items() if k.startswith("peer")), ""))
    return (f"{key:22s} held {r['held_after_load_over_weights']:.2f}x / {r['held_after_decode_over_weights']:.2f}x "
            f"of {r['weights_bytes'] / 1e9:.2f} GB; decode {r['decode_tok_s']:.2f} tok/s = "
            f"{r['decode_over_floor']:.2f} of the floor ({r['floor_tok_s']:.2f}, {r['read_gb_s']:.1f} GB/s); "
            + (f"{peer_text}; " if peer_text else "") + f"inspected/plain decode {r['inspected_over_plain_decode']:.2f}; "
            f"{r['decode_path']}; load average {r['load_average_1m']:.1f}")


if __name__ == "__main__":      # the children: python -m engine.bench.sizes probe|peer PATH DTYPE
    import engine  # noqa: F401  (the thread policy, before torch's threads start)
    print(json.dumps({"probe": probe, "peer": peer}[sys.argv[1]](*sys.argv[2:])))
