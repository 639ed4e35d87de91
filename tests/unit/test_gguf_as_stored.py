"""A GGUF file loaded "as stored" (engine.gguf_stored, load_model(quant="stored")): its matrices kept as QuantMatrix
in the file's own block bytes, held to the same file loaded dequantised (the import: gguf.quants.dequantize of every
tensor, then the float forward), which is the independent reference.

Tolerance: both runs compute with the very same weight values (QuantMatrix.dequantize is gguf.quants.dequantize
exactly, tested in test_quant_matrix.py); only the order of the float32 sums differs (the native kernel's blocks vs
MKL's). One product of length K then differs by at most gamma_K = K u / (1 - K u) of sum |x w| (u = 2^-24), about
1.5e-5 relative for K = 256 and smaller for the tiny model's 64; through one block, the norm and the head a few such
errors add up. LOGITS_RTOL = 1e-4 of the logits' scale (max |logit|) leaves that a margin of several times."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT               # noqa: E402
from gguf.quants import dequantize, quantize              # noqa: E402

from engine import load_model                             # noqa: E402
from engine.generate import generate
from engine.errors import EngineError                     # noqa: E402
from engine.gguf_file import open_gguf                    # noqa: E402
from engine.inspection.probe import Probe, inspection_probe   # noqa: E402
from engine.quant_matrix import QuantMatrix               # noqa: E402
from engine.sampling import SamplingParams                # noqa: E402

pytestmark = pytest.mark.unit

LOGITS_RTOL = 1e-4
D, HEADS, KV = 64, 4, 2
# Each matrix in its own format; q, k, v share one (fused into one product), as do gate and up.
FORMATS = {"token_embd.weight": "Q8_0", "output.weight": "Q4_1", "blk.0.attn_q.weight": "Q8_0",
           "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q8_0", "blk.0.attn_output.weight": "Q5_1",
           "blk.0.ffn_gate.weight": "Q4_0", "blk.0.ffn_up.weight": "Q4_0", "blk.0.ffn_down.weight": "Q5_0"}


def k_quant_blocks(rows: int, K: int, seed: int) -> np.ndarray:
    """Q4_K rows: random bytes with small finite fp16 super-block scales d, dmin (bytes 0-3), valid blocks
    (gguf-py cannot quantize to Q4_K)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, K // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        raw[..., at:at + 2] = rng.uniform(-2.0 ** -5, 2.0 ** -5, (rows, K // 256)).astype(np.float16)[..., None].view(
            np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, *, tied: bool = False, k_quant: bool = False, bias: bool = False) -> Path:
    """A one-layer Llama GGUF, byte-level tokenizer, its matrices in FORMATS (ffn_down Q4_K with k_quant; q/k/v
    biases in float32 with bias)."""
    from engine.gguf_tokenizer import BYTE_TO_CHAR

    tokens = ["<|end|>", "<s>"] + [BYTE_TO_CHAR[b] for b in range(256)] + ["he", "ll", "hell", "hello", "Ġhello"]
    f, vocab, hd = (256 if k_quant else 96), len(tokens), D // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_context_length, 64), (w.add_embedding_length, D), (w.add_feed_forward_length, f),
                   (w.add_block_count, 1), (w.add_head_count, HEADS), (w.add_head_count_kv, KV),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_tokenizer_model, "gpt2"),
                   (w.add_tokenizer_pre, "llama-bpe"), (w.add_token_list, tokens),
                   (w.add_token_types, [3, 3] + [1] * (len(tokens) - 2)),
                   (w.add_token_merges, ["h e", "l l", "he ll", "hell o", "Ġ hello"]), (w.add_bos_token_id, 1),
                   (w.add_eos_token_id, 0)):
        add(v)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, D), "output_norm.weight": (D,), "output.weight": (vocab, D),
              "blk.0.attn_norm.weight": (D,), "blk.0.attn_q.weight": (HEADS * hd, D),
              "blk.0.attn_k.weight": (KV * hd, D), "blk.0.attn_v.weight": (KV * hd, D),
              "blk.0.attn_output.weight": (D, HEADS * hd), "blk.0.ffn_norm.weight": (D,),
              "blk.0.ffn_gate.weight": (f, D), "blk.0.ffn_up.weight": (f, D), "blk.0.ffn_down.weight": (D, f)}
    if tied:
        del shapes["output.weight"]
    if bias:
        shapes |= {"blk.0.attn_q.bias": (HEADS * hd,), "blk.0.attn_k.bias": (KV * hd,), "blk.0.attn_v.bias": (KV * hd,)}
    for name, shape in shapes.items():
        values = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if name == "blk.0.ffn_down.weight" and k_quant:
            w.add_tensor(name, k_quant_blocks(D, f, seed=1), raw_dtype=QT.Q4_K)
        elif name in FORMATS:
            w.add_tensor(name, quantize(values, QT[FORMATS[name]]), raw_dtype=QT[FORMATS[name]])
        else:
            w.add_tensor(name, 1 + 0.1 * values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(tmp_path / "cache"))
    return tmp_path


def both(path: Path):
    return load_model(path, device="cpu", dtype="float32", quant="stored"), load_model(path, device="cpu",
                                                                                        dtype="float32")


def close_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= LOGITS_RTOL * b.abs().max().item(), (diff, b.abs().max().item())


IDS = torch.tensor([1, 260, 72, 101, 262, 33, 0, 5])


@pytest.mark.parametrize("tied", [False, True])
def test_the_matrices_are_kept_in_the_files_blocks_and_the_logits_match_the_dequantised_file(cache, tied):
    path = write_gguf(cache / "tiny.gguf", tied=tied)
    stored, floats = both(path)
    w = stored.weights
    assert w.tied() == tied and (w.embed is w.lm_head) == tied
    for lw in w.layers:
        for f in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert isinstance(getattr(lw, f), QuantMatrix), f
    assert isinstance(w.lm_head, QuantMatrix) and isinstance(w.embed, QuantMatrix)
    # bytes held: every quantised tensor's block bytes in the file, once; the norms as float32
    file = open_gguf(path)
    by_format = {}
    for t in file.tensors:
        fmt = t.tensor_type.name
        if fmt != "F32":
            by_format[fmt] = by_format.get(fmt, 0) + int(np.asarray(t.data).nbytes)
    held = w.nbytes_by_dtype()
    assert {k: v for k, v in held.items() if isinstance(k, str)} == by_format
    assert held[torch.float32] == 3 * D * 4 and w.notes == []
    close_logits(stored.logits(IDS), floats.logits(IDS))
    greedy = SamplingParams(temperature=0.0)
    assert generate(stored, IDS[:3], max_new_tokens=6, ignore_eos=True, params=greedy).token_ids == \
        generate(floats, IDS[:3], max_new_tokens=6, ignore_eos=True, params=greedy).token_ids


def test_q_and_k_block_rows_are_unpermuted_as_the_import_unpermutes_the_values(cache):
    stored, floats = both(write_gguf(cache / "tiny.gguf"))
    assert torch.equal(stored.weights.layers[0].wqkv.dequantize(), floats.weights.layers[0].wqkv)
    assert torch.equal(stored.weights.lm_head.dequantize(), floats.weights.lm_head)


def test_embedding_rows_by_id_are_gguf_dequantize_of_those_rows(cache):
    path = write_gguf(cache / "tiny.gguf")
    m = load_model(path, quant="stored").weights.embed
    tensor = next(t for t in open_gguf(path).tensors if t.name == "token_embd.weight")
    want = dequantize(np.asarray(tensor.data), QT.Q8_0)           # (V, d)
    ids = torch.tensor([[3, 0], [260, 3]])
    assert torch.equal(m.rows(ids), torch.from_numpy(want[ids.numpy()]))
    with pytest.raises(IndexError, match="token_embd.weight"):
        m.rows(torch.tensor([want.shape[0]]))


def test_a_q4_k_layer_is_kept_and_matches_its_dequantised_value(cache):
    stored, floats = both(write_gguf(cache / "k.gguf", k_quant=True))
    down = stored.weights.layers[0].w_down
    assert isinstance(down, QuantMatrix) and down.format == "Q4_K"
    assert stored.weights.nbytes_by_dtype()["Q4_K"] == D * 144
    close_logits(stored.logits(IDS), floats.logits(IDS))


def test_the_native_step_takes_the_quantized_weights_and_inspection_runs(cache):
    stored, floats = both(write_gguf(cache / "tiny.gguf"))
    assert stored.accelerator.decode is not None and stored.accelerator.why_not == ""
    probe = inspection_probe()
    run = generate(stored, IDS[:4], max_new_tokens=3, ignore_eos=True, probe=probe,
                   params=SamplingParams(temperature=0.0))
    ref_probe = inspection_probe()
    ref = generate(floats, IDS[:4], max_new_tokens=3, ignore_eos=True, probe=ref_probe,
                   params=SamplingParams(temperature=0.0))
    assert run.token_ids == ref.token_ids
    got, want = probe.recording.stat_records(), ref_probe.recording.stat_records()
    assert [(r.name, r.layer) for r in got] == [(r.name, r.layer) for r in want] and got


def test_a_weight_override_on_a_quantized_matrix_works_on_its_dequantised_value(cache):
    stored, floats = both(write_gguf(cache / "tiny.gguf"))
    seen = {}

    def double(w):
        seen["w"] = w.clone()
        return 2 * w
    a = stored.logits(IDS, Probe().override_weight("blocks.0.mlp.w_down", double))
    b = floats.logits(IDS, Probe().override_weight("blocks.0.mlp.w_down", lambda w: 2 * w))
    assert torch.equal(seen["w"], floats.weights.layers[0].w_down)        # the dequantised value, (in, out)
    close_logits(a, b)
    e = stored.logits(IDS, Probe().override_weight("embed.weight", lambda w: 0 * w))
    ez = floats.logits(IDS, Probe().override_weight("embed.weight", lambda w: 0 * w))
    close_logits(e, ez)
    assert isinstance(stored.weights.layers[0].w_down, QuantMatrix)       # the shared model is untouched


def test_stored_is_refused_for_a_non_gguf_source_and_a_bad_mode(cache, tiny_model_dir):
    with pytest.raises(EngineError, match="not a .gguf file"):
        load_model(tiny_model_dir, quant="stored")
    with pytest.raises(EngineError, match="unsupported quant 'q4'"):
        load_model(tiny_model_dir, quant="q4")
    with pytest.raises(EngineError, match="CPU in float32"):
        load_model(write_gguf(cache / "tiny.gguf"), dtype="bfloat16", quant="stored")


def test_tools_that_read_float_matrices_use_the_dequantised_values(cache):
    """Direct logit attribution, occlusion, casts and head ablation on a model kept quantised: each reads the
    dequantised matrices, so it gives the dequantised file's answer (the same values; products within LOGITS_RTOL)."""
    from engine.tools.attribution import occlusion
    from engine.tools.dla import direction, parts
    from engine.variants import cast_model, without_heads

    stored, floats = both(write_gguf(cache / "tiny.gguf"))
    resid = torch.randn(D, generator=torch.Generator().manual_seed(3))
    (ds, ss), (df, sf) = direction(stored, resid, 5, 260), direction(floats, resid, 5, 260)
    assert torch.equal(ds, df) and ss == sf
    got = {"embed": resid.double(), "blocks.0.attn.z": torch.randn(HEADS, D // HEADS).double(),
           "blocks.0.attn_out": resid.double(), "blocks.0.mlp_out": resid.double()}
    assert parts(stored, got, ds, 0)[0] == parts(floats, got, df, 0)[0]      # at position 0
    ids = IDS[:5].tolist()
    assert np.allclose(occlusion(stored, ids, 7, 3), occlusion(floats, ids, 7, 3), rtol=0, atol=1e-4)
    assert stored.weights.embed_rows(3).shape == (D,)
    cast = cast_model(stored, "float32")
    assert not cast.weights.quantized() and torch.equal(cast.weights.layers[0].w_down, floats.weights.layers[0].w_down)
    close_logits(without_heads(stored, [(0, 1)]).logits(IDS), without_heads(floats, [(0, 1)]).logits(IDS))


def test_a_load_as_stored_writes_no_dequantised_import(cache):
    """Only config.json and the tokenizer are written for it: a file too large for memory as floats still loads."""
    from engine.sources import import_dir_for, stored_dir

    path = write_gguf(cache / "tiny.gguf")
    model = load_model(path, quant="stored")
    assert not import_dir_for(path).exists()
    assert model.path == stored_dir(path) and not list(model.path.glob("*.safetensors"))
    assert model.tokenizer.eos_ids == load_model(path).tokenizer.eos_ids


def cli_generate(path, quant: str, monkeypatch):
    """`engine generate` on the file with --quant quant -> (exit code, the models the CLI loaded)."""
    from engine.cli import args as cli_args, main

    loaded = []
    real = cli_args.load_model
    monkeypatch.setattr(cli_args, "load_model", lambda *a, **kw: loaded.append(real(*a, **kw)) or loaded[-1])
    return main(["generate", "hello", "--model", str(path), "--quant", quant, "--max-new-tokens", "2"]), loaded


def test_the_cli_loads_a_gguf_as_stored_with_quant_stored(cache, capsys, monkeypatch):
    code, loaded = cli_generate(write_gguf(cache / "tiny.gguf"), "stored", monkeypatch)
    assert code == 0
    assert loaded and loaded[-1].weights.quantized() and "weights kept quantized" in capsys.readouterr().err


def test_a_qkv_with_a_bias_is_dequantised_and_noted(cache):
    """The biased q/k/v product is one float addmm in the model's block: that matrix is dequantised, said in the
    notes, and the logits still match the dequantised file."""
    stored, floats = both(write_gguf(cache / "bias.gguf", bias=True))
    lw = stored.weights.layers[0]
    assert lw.bqkv is not None and not isinstance(lw.wqkv, QuantMatrix) and isinstance(lw.wo, QuantMatrix)
    assert stored.weights.notes == ["layer 0: q/k/v with a bias (Q8_0) dequantised to float32"]
    assert torch.equal(lw.wqkv, floats.weights.layers[0].wqkv) and torch.equal(lw.bqkv, floats.weights.layers[0].bqkv)
    close_logits(stored.logits(IDS), floats.logits(IDS))


def test_an_override_on_a_quantized_matrix_says_in_the_runs_notes_that_it_worked_on_the_dequantised_value(cache):
    """Issue 44 item 3: the doctor's weight fault and a run's record both say, by weight and format, that the
    override worked on the dequantised float32 values; a float model's run, and a fault on a stage, say nothing."""
    from engine import RunSettings, make_trace
    from engine.tools.doctor import run_doctor

    stored, floats = both(write_gguf(cache / "tiny.gguf"))
    report = run_doctor(stored, [1, 260, 72], injections=["scale=2@blocks.0.mlp.w_down"], max_new_tokens=2)
    (note,) = report.notes
    assert note.startswith("weight override blocks.0.mlp.w_down (Q5_0, kept quantized): ") and \
        "dequantised float32" in note and report.as_dict()["notes"] == [note]
    assert not run_doctor(floats, [1, 260, 72], injections=["scale=2@blocks.0.mlp.w_down"], max_new_tokens=2).notes
    assert not run_doctor(stored, [1, 260, 72], injections=["zero@blocks.0.mlp_out"], max_new_tokens=2).notes
    trace = make_trace(RunSettings(prompt="x", chat=False), report.result, report.probe, stored.name, 0.1)
    assert trace.notes == [note]


def _mapped_kb(address: int) -> int:
    """Resident kB of the one mapping of this process that starts at `address` (/proc/self/smaps). Only that
    mapping: other readers of the same file in this process (the session's shared one, other tests') have their own
    mappings of it, resident as they read them."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:             # a mapping's header line: "start-end perms ... path"
            mine = int(head.split("-")[0], 16) == address
        elif mine and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_the_stored_load_leaves_no_copied_tensor_mapped():
    """Reading a GGUF as stored copies each tensor's bytes out of the mapped file and then drops those pages from
    the process (GGUFFile.release): the blocks are held once, not beside the whole file mapped (the 8B-shaped Q4_K
    file peaked at 8.6 GB of RSS for 4.5 GB of blocks before). What stays resident of the mapping is its metadata
    (the tokenizer's lists) and what the kernel's fault-around maps beside each read (up to 64 kB a fault, its
    default fault_around_bytes, of pages already cached)."""
    from engine.sources import bundled_gguf
    path = Path(bundled_gguf()).resolve()
    f = open_gguf(path)             # a reader of its own: the session's shared one is read by other tests
    size_kb = path.stat().st_size // 1024
    copies = []
    for t in f.tensors:
        copies.append(np.array(t.data))
        f.release(t)
    head_kb = f.tensors[0].data_offset // 1024 + 1
    left = _mapped_kb(f.data.ctypes.data)       # the start of this reader's own mapping of the file
    assert left <= head_kb + 64 * len(f.tensors) < size_kb / 3, (left, head_kb, size_kb)
    assert sum(c.nbytes for c in copies) > 0.9 * size_kb * 1024            # the bytes were read, and are held once
    assert all(np.array_equal(c, t.data) for c, t in zip(copies[:3], f.tensors[:3]))   # a released view reads again
