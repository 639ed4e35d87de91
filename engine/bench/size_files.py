"""The GGUF files bench --sizes opens (engine.bench.sizes): a model of a public config's shape, every matrix in one
quantised format, written the way llama.cpp's converter and llama-quantize lay a file out for its family (the
architecture's metadata keys, its tensor names: engine.gguf_names, from the family's declared checkpoint), with random
weights, one tensor at a time (the tensor infos first, then each tensor's bytes made and written in turn: an 8B file
never sits in memory whole).

Weights: random block bytes with the block's fp16 scales set small and finite are valid blocks of every format
(gguf-py can dequantise K-quants but not quantise them, and random bytes cost nothing to make): each format's scales
below. Norms are float32 ones (as llama-quantize leaves them; the Gemma converters store 1 + w, so ones are w = 0).
A matrix whose rows are not whole blocks of the format (Gemma-3-1B's 1,152 columns in Q4_K's 256-value super-blocks)
takes llama-quantize's fallback for the format (Q4_K -> Q5_0, llama-quant.cpp), as a real file of that model does.

The vocabulary is the shape's (vocab_size written, as LlamaModel writes it; the importer reads it before the token
list's length), the tokenizer the bundled model's (49,152 tokens, inside every shape's vocabulary: the bench feeds
token ids). Left out: llama3's rope_freqs.weight (the rope factors change no cost the bench measures)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

FORMATS = ("Q8_0", "Q4_K")            # the formats bench --sizes writes each public shape in
FALLBACK = {"Q4_K": "Q5_0"}           # llama-quantize's type for rows that are not whole super-blocks
# Each format's fp16 scales: (byte offset, value) in a block, and whether the value is over sqrt(K). Q8_0 / Q5_0: d,
# so that d * q has a standard deviation near 1 / sqrt(K) (uniform int8: std 74; Q5_0's q - 16: std 9.2); Q4_K: its
# super-block's d and dmin, the values the 8B file was first written with (|w| <= 0.001 * 63 * 15 + 0.0005 * 63).
SCALES = {"Q8_0": (((0, 1 / 74),), True), "Q5_0": (((0, 1 / 9.2),), True),
          "Q4_K": (((0, 0.001), (2, 0.0005)), False)}
WRITTEN = ("llama", "qwen3", "gemma3_text")     # the families whose converter's metadata _metadata writes


def file_name(shape: str, fmt: str) -> str:
    # the 8B file keeps the name it was first cached under (v2: it says its vocabulary, 128,256, more than the
    # tokenizer's list): the same shapes, types and scales as this writer's
    return "llama-3.1-8b.Q4_K.v2.gguf" if (shape, fmt) == ("llama-3.1-8b", "Q4_K") else f"{shape}.{fmt}.gguf"


def write_gguf(shape: str, raw: dict, fmt: str, out: Path, seed: int = 0) -> Path:
    """The GGUF file of this shape (raw: its config.json's fields) with every matrix in fmt (or its fallback), under
    out (written once; a finished file is reused)."""
    import gguf

    path = out / file_name(shape, fmt)
    if path.is_file():
        return path
    out.mkdir(parents=True, exist_ok=True)
    cfg, fam, tensors = _tensors(shape, raw)
    rng = np.random.default_rng(seed)
    tmp = str(path) + ".tmp"
    w = gguf.GGUFWriter(tmp, fam.gguf_arch)
    _metadata(w, raw, cfg, fam)
    _tokenizer(w)
    made = []                                    # (name, shape, format): the infos' order is the data's
    for name, dims in tensors.items():
        tensor_fmt = None if len(dims) == 1 else matrix_format(fmt, dims[-1])
        made.append((name, dims, tensor_fmt))
        if tensor_fmt is None:
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            rows = _row_bytes(tensor_fmt, dims[-1])
            w.add_tensor_info(name, (dims[0], rows), np.dtype(np.uint8), dims[0] * rows,
                              raw_dtype=gguf.GGMLQuantizationType[tensor_fmt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, tensor_fmt in made:
        w.write_tensor_data(np.ones(dims, np.float32) if tensor_fmt is None else blocks(tensor_fmt, dims, rng))
    w.close()
    os.replace(tmp, path)
    return path


def matrix_format(fmt: str, cols: int) -> str:
    """The format a matrix of `cols` columns is stored in: fmt where its rows are whole blocks, else the fallback."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    if cols % GGML_QUANT_SIZES[GGMLQuantizationType[fmt]][0] == 0:
        return fmt
    if fmt not in FALLBACK:
        raise ValueError(f"{cols} columns are not whole {fmt} blocks, and {fmt} has no fallback format here")
    return matrix_format(FALLBACK[fmt], cols)


def blocks(fmt: str, dims: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random blocks of fmt with its fp16 scales set (SCALES)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    rows, cols = dims
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales, per_root_k = SCALES[fmt]
    root = cols ** -0.5 if per_root_k else 1.0
    for at, value in scales:
        raw[..., at:at + 2] = np.frombuffer(np.float16(value * root).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _row_bytes(fmt: str, cols: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    return cols // block * size


def _tensors(shape: str, raw: dict):
    """The config, family and {GGUF name: numpy shape (out, in)} of every tensor the engine expects for it
    (engine.weights.expected_tensors under llama.cpp's names, engine.gguf_names)."""
    from engine.config import ModelConfig
    from engine.family import FAMILIES
    from engine.family.declared import LLAMA_CHECKPOINT
    from engine.gguf_names import global_map, layer_map
    from engine.weights import expected_tensors
    fam = FAMILIES[raw["model_type"]]
    if raw["model_type"] not in WRITTEN or fam.checkpoint != LLAMA_CHECKPOINT or fam.experts:
        raise ValueError(f"{shape}: the bench's GGUF writer writes {', '.join(WRITTEN)} files, not "
                         f"{raw['model_type']}'s")
    cfg = ModelConfig.from_dict({**raw, "bos_token_id": 1, "eos_token_id": 2}, where=shape)
    to_gguf = {hf: g for g, hf in global_map(fam).items()}
    per_layer = {hf: g for g, hf in layer_map(fam).items()}
    out = {}
    for hf, dims in expected_tensors(cfg).items():
        if hf not in to_gguf:
            layer, rest = hf.removeprefix("model.layers.").split(".", 1)
            if rest not in per_layer:
                raise ValueError(f"{shape}: tensor {hf} has no llama.cpp name for {fam.model_type}")
        out[to_gguf[hf] if hf in to_gguf else f"blk.{layer}.{per_layer[rest]}"] = tuple(int(d) for d in dims)
    return cfg, fam, out


def _metadata(w, raw: dict, cfg, fam) -> None:
    """The keys llama.cpp's converter writes for the family (TextModel's, LlamaModel's and Gemma3Model's own)."""
    for add, value in (("block_count", cfg.num_layers), ("context_length", raw["max_position_embeddings"]),
                       ("embedding_length", raw["hidden_size"]), ("feed_forward_length", raw["intermediate_size"]),
                       ("head_count", cfg.num_heads), ("head_count_kv", cfg.num_kv_heads),
                       ("rope_freq_base", float(raw["rope_theta"])), ("layer_norm_rms_eps", raw["rms_norm_eps"]),
                       ("vocab_size", raw["vocab_size"])):
        getattr(w, f"add_{add}")(value)
    if "head_dim" in raw:
        w.add_key_length(raw["head_dim"])
        w.add_value_length(raw["head_dim"])
    if fam.gguf_permutes_qk:
        w.add_rope_dimension_count(cfg.head_dim)
    if fam.local_rope:              # Gemma3Model
        w.add_sliding_window(raw["sliding_window"])


def _tokenizer(w) -> None:
    from engine.gguf_file import open_gguf
    from engine.sources import bundled_gguf
    src = open_gguf(bundled_gguf())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src.fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(src.fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(src.fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(src.fields["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
