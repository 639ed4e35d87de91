"""Import a GGUF file into a Hugging Face style directory (config.json, model.safetensors, tokenizer files).

Tensors are dequantised with the `gguf` package. llama.cpp's converter permutes the rows of the q and k
projections (its RoPE rotates adjacent pairs; HF's rotates halves), so they are permuted back here.
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

from engine.errors import ModelLoadError, UnsupportedModelError

IMPORT_VERSION = 1
Progress = Callable[[float, str], None]
SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2"}

LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_MAP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: recomputed from config.rope_scaling


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_MAP:
        return GLOBAL_MAP[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_MAP:
        return f"model.layers.{parts[1]}.{LAYER_MAP[parts[2]]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers: _reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"GGUF general.architecture={arch!r} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ARCHS)}")

    def need(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": SUPPORTED_ARCHS[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(np.float32(need("attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    # rms_norm_eps is stored as float32 in GGUF (9.9999997e-06); report the value it was trained with.
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {_field(reader, f'{arch}.rope.scaling.type')!r} "
                                    "is not supported by the importer")
    return cfg


def dequantized_tensors(reader, cfg: dict, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    tensors = [t for t in reader.tensors if t.name not in SKIPPED]
    for n, t in enumerate(tensors):
        try:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError, KeyError, TypeError) as e:
            raise UnsupportedModelError(f"tensor {t.name}: quantization type {getattr(t.tensor_type, 'name', '?')} "
                                        f"cannot be dequantised here ({type(e).__name__})") from None
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims innermost first
        arr = arr.reshape(shape)
        if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
            arr = unpermute(arr, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
            arr = unpermute(arr, cfg["num_key_value_heads"])
        arr = np.ascontiguousarray(arr)
        out[hf_name(t.name)] = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if progress and n % 8 == 0:
            progress(0.9 * (n + 1) / len(tensors), f"dequantising {t.name}")
    return out


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> Path:
    """Write an HF-layout directory for gguf_path at out_dir (atomically). Returns out_dir."""
    import gguf

    from engine.gguf_tokenizer import tokenizer_files_from_gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    progress = progress or (lambda f, m: None)
    progress(0.0, f"reading {gguf_path.name}")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file: {e}") from None
    cfg = config_from_gguf(reader)
    tensors = dequantized_tensors(reader, cfg, progress)
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ModelLoadError(f"{gguf_path.name}: the GGUF file carries no tokenizer (tokenizer.ggml.tokens)")
    tok_json, tok_cfg = tokenizer_files_from_gguf(reader)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        progress(0.92, "writing model.safetensors")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False), encoding="utf-8")
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        (tmp / "import.json").write_text(json.dumps({"import_version": IMPORT_VERSION, **source_facts(gguf_path)}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(1.0, f"imported {gguf_path.name}")   # progress may reach a browser: the file's name, not a folder
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
