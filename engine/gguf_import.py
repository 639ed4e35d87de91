"""Import a GGUF file into a Hugging Face style directory (config.json, model.safetensors, tokenizer files).

The file's family is its general.architecture (engine.family.family_for_gguf; llama files with stacked experts are
mixtral), and its tensor names come from that family's declared parts and checkpoint (engine.gguf_names), so there
is no second list of names here. config.json is rebuilt from the metadata keys llama.cpp's converter writes for the
family, and from what llama.cpp hard-codes instead (each said where). What cannot be mapped faithfully (phi3
longrope's factor tensors, rope scaling other than linear or llama3's factors) is refused, naming it.

Tensors are dequantised with the `gguf` package and put back in the checkpoint's layout where the converter changed
it (engine.gguf_names.to_checkpoint: q/k rows permuted back, Gemma's 1 + w norms, GPT-2's Conv1D transposes,
GPT-NeoX's per-head q/k/v).
The directory is written to a temporary name and renamed into place, so an interrupted import never
leaves a half-written model behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.family import FAMILIES, Family, family_for_gguf
from engine.gguf_names import SKIPPED, hf_name, to_checkpoint
from engine.memory import check_fits, gb

IMPORT_VERSION = 1
Progress = Callable[[float, str], None]

REFUSED = {"rope_factors_long.weight": "phi3 longrope's rope_factors_long/short tensors",
           "rope_factors_short.weight": "phi3 longrope's rope_factors_long/short tensors"}
# llama.cpp's gemma2 and gemma3 take the 27B models' query scale from hidden / heads (query_pre_attn_scalar 144), every
# other size's from head_dim (llama-model.cpp, f_attention_scale); the 27B models are told by their layer count.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def family_of(reader) -> Family:
    """The declared family of a GGUF file: its general.architecture, and whether it holds stacked experts
    (engine.family.family_for_gguf)."""
    return family_for_gguf(_field(reader, "general.architecture"),
                           any(t.name.endswith(".ffn_gate_exps.weight") for t in reader.tensors))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(v) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (the value the model was given:
    1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(v)))


def config_from_gguf(reader) -> dict:
    """config.json for a GGUF file, from the metadata keys llama.cpp's converter writes for its family."""
    fam = family_of(reader)
    arch = fam.gguf_arch

    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key: str):
        v = get(key)
        if v is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return v

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": _head_dim(fam, get, hidden, heads),
        "rms_norm_eps": _f32(need("attention.layer_norm_epsilon" if fam.norm == "layer"
                                  else "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": _tied(reader, names),
        "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[fam.activation],
        "attention_bias": "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    for name, why in REFUSED.items():
        if name in names:
            raise UnsupportedModelError(f"GGUF tensor {name}: {why} cannot be mapped to a config the engine reads")
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != cfg["head_dim"]:
        if not fam.rotary_fraction:
            raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count={rot} differs from head_dim="
                                        f"{cfg['head_dim']}: a partial rotary is not declared for {fam.model_type}")
        cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
    cfg |= _rope_scaling(reader, fam, get, cfg) | _block_variations(fam, get, cfg, names)
    return cfg


def _tied(reader, names: set) -> bool:
    """No output.weight, or one that is token_embd.weight byte for byte: GPT2Model writes GPT-2's tied head out as
    a copy of the embedding (the same product either way; tied, the import holds it once, as transformers saves
    it)."""
    if "output.weight" not in names:
        return True
    out, embed = (next(t for t in reader.tensors if t.name == n) for n in ("output.weight", "token_embd.weight"))
    return out.tensor_type == embed.tensor_type and np.array_equal(np.asarray(out.data), np.asarray(embed.data))


def _head_dim(fam: Family, get, hidden: int, heads: int) -> int:
    """attention.key_length where written (a head_dim in the HF config); otherwise llama.cpp's default, hidden /
    heads, except that older llama files give it as rope.dimension_count only (phi3's is its rotary part)."""
    if get("attention.key_length") is not None:
        return int(get("attention.key_length"))
    rot = get("rope.dimension_count")
    return int(rot) if rot is not None and not fam.rotary_fraction else hidden // heads


def _rope_scaling(reader, fam: Family, get, cfg: dict) -> dict:
    kind = get("rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported by the importer")
    out = {}
    if kind == "linear":      # gemma3 writes it for its global layers only, as transformers applies it
        out["rope_scaling"] = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor", 1.0))}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if out or "llama3" not in fam.rope_types:
            raise UnsupportedModelError("GGUF tensor rope_freqs.weight: per-frequency rope factors are read back "
                                        f"as llama3 scaling only, not for {fam.model_type} or with {kind} scaling")
        rot = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
        scaling = _llama3_scaling(np.asarray(freqs.data, np.float64).ravel(), cfg["rope_theta"], rot)
        out |= {"rope_scaling": scaling} if scaling else {}
    return out


def _llama3_scaling(factors: np.ndarray, theta: float, dim: int) -> dict | None:
    """The llama3 rope_scaling whose factors llama.cpp's converter wrote as rope_freqs.weight (its LlamaModel:
    1 above the high-frequency wavelength, `factor` past the low one, smoothed between). Only the ratios of
    original_max_position_embeddings to low/high_freq_factor matter, so low_freq_factor is read as 1; with fewer
    than two smoothed frequencies high_freq_factor is taken as 4 (Meta's). Refused unless the factors recompute."""
    factor = float(factors.max())
    if len(factors) and np.all(factors == 1):
        return None
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    if len(factors) != len(wavelen) or factor < 1:
        raise UnsupportedModelError(f"GGUF tensor rope_freqs.weight: {len(factors)} factors for {len(wavelen)} "
                                    "rotary frequencies")
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    high = 4.0
    if mid.sum() >= 2:       # smooth = (orig / wavelen - low) / (high - low): a line in 1 / wavelen
        slope, icpt = np.polyfit(1 / wavelen[mid], smooth, 1)
        high = float(f"{1 - 1 / icpt:.6g}")
    orig = int(round(float(np.mean(wavelen[mid] * ((high - 1) * smooth + 1))))) if mid.any() else None
    if orig is None:        # no smoothed frequency: any band between the last 1 and the first `factor` fits
        orig = int(np.ceil(wavelen[factors < factor * (1 - 1e-6)].max() * high)) if (factors < factor).any() else 1
    scaling = {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": 1.0, "high_freq_factor": high,
               "original_max_position_embeddings": orig}
    if not np.allclose(_llama3_factors(scaling, wavelen), factors, rtol=1e-5, atol=0):
        raise UnsupportedModelError("GGUF tensor rope_freqs.weight: its factors are not llama3 rope scaling")
    return scaling


def _llama3_factors(s: dict, wavelen: np.ndarray) -> np.ndarray:
    orig, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                               s["factor"])
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _block_variations(fam: Family, get, cfg: dict, names: set) -> dict:
    """The family's variations: written by llama.cpp as metadata, or hard-coded by it (said where)."""
    layers, out = cfg["num_hidden_layers"], {}
    window = get("attention.sliding_window")
    if fam.windows and window:        # phi3 writes 0 for "no window"
        out["sliding_window"] = int(window)
    if fam.windows == "layer_types" and window:
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
        else:   # llama-model.cpp: gemma2 set_swa_pattern(2), gemma3 set_swa_pattern(6): every n-th layer is global
            n = int(pattern or (6 if fam.local_rope else 2))
            sliding = [bool((i + 1) % n) for i in range(layers)]
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if fam.local_rope:      # llama-model.cpp, gemma3: rope_freq_base_train_swa = 10000
        out["rope_local_base_freq"] = 10000.0
    if fam.query_scale:     # llama-model.cpp, gemma2/gemma3: f_attention_scale (GEMMA_27B_LAYERS)
        big = layers == GEMMA_27B_LAYERS.get(fam.gguf_arch)
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    if fam.softcaps and fam.gguf_arch == "gemma2":     # llama.cpp's gemma3 computes no soft caps
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                out[key] = _f32(get(key))
    if fam.multipliers:     # granite: absent keys are llama.cpp's defaults (attention scale 1 / sqrt(head_dim))
        for key, hf, default in (("embedding_scale", "embedding_multiplier", 1.0),
                                 ("residual_scale", "residual_multiplier", 1.0),
                                 ("attention.scale", "attention_multiplier", cfg["head_dim"] ** -0.5),
                                 ("logit_scale", "logits_scaling", 1.0)):
            v = get(key)
            out[hf] = _f32(v) if v else default
    if get("use_parallel_residual") is not None:     # GPTNeoXModel and StableLMModel write it
        out["use_parallel_residual"] = bool(get("use_parallel_residual"))
    if fam.logit_scale:     # CommandR2Model writes logit_scale; llama.cpp multiplies the logits by it
        if get("logit_scale") is None:
            raise ModelLoadError(f"GGUF metadata lacks {fam.gguf_arch}.logit_scale")
        out["logit_scale"] = _f32(get("logit_scale"))
    if fam.no_rope_layers:  # llama-model.cpp, smollm3: n_no_rope_layer_step = 4 (every 4th layer has no RoPE)
        out["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(layers)]
    if fam.experts:
        out |= _experts_config(fam, get, layers, names)
    return out


def _experts_config(fam: Family, get, layers: int, names: set) -> dict:
    gating = get("expert_gating_func")
    if gating not in (None, 1):        # 1: softmax, the only gating mixtral and qwen3moe use
        raise UnsupportedModelError(f"GGUF expert_gating_func={gating!r} is not supported (softmax only)")
    n, k = int(get("expert_count") or 0), int(get("expert_used_count") or 0)
    if fam.experts == "mixtral":
        return {"num_local_experts": n, "num_experts_per_tok": k}
    # qwen3moe: llama.cpp renormalises the top-k weights (norm_w = true in its graph) unless the file says
    # otherwise; a layer without a router (ffn_gate_inp) holds a dense MLP (transformers' mlp_only_layers).
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return {"num_experts": n, "num_experts_per_tok": k, "decoder_sparse_step": 1, "mlp_only_layers": dense,
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "norm_topk_prob": bool(get("expert_weights_norm", True))}


def dequantized_tensors(reader, cfg: dict, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name, in the checkpoint's layout (engine.gguf_names.to_checkpoint),
    stacked experts split one per expert; a tied head's copy (GPT-2's output.weight) left out."""
    from gguf.quants import dequantize

    fam = FAMILIES[cfg["model_type"]]
    out: dict[str, torch.Tensor] = {}
    skipped = SKIPPED | ({"output.weight"} if cfg["tie_word_embeddings"] else set())
    tensors = [t for t in reader.tensors if t.name not in skipped]
    for n, t in enumerate(tensors):
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError, KeyError, TypeError) as e:
            raise UnsupportedModelError(f"tensor {t.name}: quantization type {getattr(t.tensor_type, 'name', '?')} "
                                        f"cannot be dequantised here ({type(e).__name__})") from None
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims innermost first
        arr = to_checkpoint(arr.reshape(shape), t.name, fam, cfg)
        name = hf_name(t.name, fam)
        for key, a in ([(name, arr)] if "{e}" not in name else [(name.format(e=e), a) for e, a in enumerate(arr)]):
            a = np.ascontiguousarray(a)
            out[key] = torch.from_numpy(a if a.flags.writeable else a.copy())
        if progress and n % 8 == 0:
            progress(0.9 * (n + 1) / len(tensors), f"dequantising {t.name}")
    return out


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> Path:
    """Write an HF-layout directory for gguf_path at out_dir (atomically). Returns out_dir."""
    from engine.gguf_tokenizer import tokenizer_files_from_gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    progress = progress or (lambda f, m: None)
    progress(0.0, f"reading {gguf_path.name}")
    reader = _reader(gguf_path)
    cfg = config_from_gguf(reader)
    # The import holds every tensor dequantised to float32 before it writes them: refused before that if they cannot fit
    check_fits(ModelConfig.from_dict(cfg, where=gguf_path.name), torch.float32,
               f"{gguf_path.name} (a GGUF file of {gb(gguf_path.stat().st_size)}, imported as float32)")
    tensors = dequantized_tensors(reader, cfg, progress)
    tok_json, tok_cfg = tokenizer_files_from_gguf(reader)

    def write(tmp: Path) -> None:
        progress(0.92, "writing model.safetensors")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    _write_dir(out_dir, gguf_path, cfg, write)
    progress(1.0, f"imported {gguf_path.name}")   # progress may reach a browser: the file's name, not a folder
    return out_dir


def write_header_dir(gguf_path: Path, out_dir: Path) -> Path:
    """out_dir with the file's config.json, tokenizer files and import.json, no weights (a load as stored reads
    them from the file itself: engine.gguf_stored), written atomically."""
    from engine.gguf_tokenizer import write_tokenizer_dir

    reader = _reader(gguf_path)
    return _write_dir(out_dir, gguf_path, config_from_gguf(reader), lambda tmp: write_tokenizer_dir(reader, tmp))


def _reader(gguf_path: Path):
    """The file opened by engine.gguf_file, refused when it is unreadable or carries no tokenizer."""
    from engine.gguf_file import open_gguf
    try:
        reader = open_gguf(gguf_path)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file: {e}") from None
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ModelLoadError(f"{gguf_path.name}: the GGUF file carries no tokenizer (tokenizer.ggml.tokens)")
    return reader


def _write_dir(out_dir: Path, gguf_path: Path, cfg: dict, write) -> Path:
    """out_dir written atomically (a temporary folder beside it, then one rename): config.json,
    generation_config.json and import.json (the source's facts), and what write(folder) adds."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        (tmp / "import.json").write_text(json.dumps({"import_version": IMPORT_VERSION, **source_facts(gguf_path)}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def source_facts(gguf_path: Path) -> dict:
    """What identifies a GGUF file's content: resolved path, size, modification time and SHA-256."""
    st = gguf_path.stat()
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return {"source": str(gguf_path.resolve()), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns,
            "source_sha256": digest.hexdigest()}


def is_imported(out_dir: Path, gguf_path: Path) -> bool:
    """An import of this file's current content is there. Path, size and time stamp unchanged: trusted; any
    of them changed: the content is hashed again and must match."""
    marker = out_dir / "import.json"
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (json.JSONDecodeError, OSError, RecursionError):
        return False
    if not isinstance(meta, dict) or meta.get("import_version") != IMPORT_VERSION:
        return False
    st = gguf_path.stat()
    same = (meta.get("source"), meta.get("source_size"), meta.get("source_mtime_ns")) == (
        str(gguf_path.resolve()), st.st_size, st.st_mtime_ns)
    return same or meta.get("source_sha256") == source_facts(gguf_path)["source_sha256"]
