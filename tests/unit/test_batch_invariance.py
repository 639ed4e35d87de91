"""Batch invariance, bit for bit (engine.batch): a run's token ids, logits, every stage's statistics and every capture
are torch.equal to the same run alone, whatever runs share its forwards, on the native path and on the PyTorch
forward, on the CPU, in float32, bfloat16 and float16.

A needle in a batch: one run (greedy, "The capital of France is", full-inspection probe) alone, then the same run in
20 trials, each among 1 to 30 other runs (random prompts of 1 to 48 tokens: those over engine.matmul.TILED_ROWS prefilled alone, random lengths of generation, sampled
or greedy), driven by one StepBarrier, one thread a run, as the app drives its users' runs: some start with the
needle (their prefills packed with its prompt), the others join when the needle has drawn a random number of
tokens (their prefills packed among themselves while the needle decodes; then batched decode steps with it) and
leave at their own ends. The reference is the needle alone; the comparison is the determinism doctor's
(engine.tools.determinism.compare: tokens, every step's logits, every statistics record in forward order, each
torch.equal), and on the PyTorch forward every capture of the captured stages besides. A stage's statistics of one row
are the same alone and beside rows that hold a NaN, an Inf or a mean that dwarfs their spread (which each backend
hands to the reference statistics), with each statistics backend."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from engine import GenerationRun, SamplingParams
from engine.accelerator import PLAIN
from engine.batch import StepBarrier
from engine.inspection.probe import inspection_probe
from engine.inspection.row_stats import PYTORCH, REFERENCE, chain
from engine.inspection.stats import StatsBatcher
from engine.native.inspect import NATIVE
from engine.tools.determinism import compare

pytestmark = pytest.mark.unit

NEEDLE = "The capital of France is"
NEW = 6                 # the needle's tokens
TRIALS = 20
CAPTURED = ("blocks.0.attn_norm", "blocks.1.mlp_out", "blocks.1.attn.pattern", "final_norm")


def _probe(captures: bool):
    probe = inspection_probe(timing=False)
    return probe.capture(list(CAPTURED)) if captures else probe


def _needle(model, captures: bool, on_token=None) -> GenerationRun:
    return GenerationRun(model, NEEDLE, params=SamplingParams(temperature=0), max_new_tokens=NEW, ignore_eos=True,
                         probe=_probe(captures), on_token=on_token)


def _other(model, rng: random.Random) -> GenerationRun:
    ids = [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(1, 48))]
    params = SamplingParams(temperature=0) if rng.random() < 0.5 else SamplingParams(temperature=0.9, top_k=50)
    return GenerationRun(model, ids, params=params, seed=rng.randrange(1000), max_new_tokens=rng.randint(1, 10),
                         ignore_eos=True, probe=inspection_probe(timing=False) if rng.random() < 0.7 else None)


def _in_batch(model, captures: bool, rng: random.Random) -> tuple[GenerationRun, tuple[int, bool]]:
    """The needle among 1-30 others, each arriving at a random step of the needle's -> (the needle, (how many of
    its decode steps were batched, whether its prompt was packed with others'))."""
    n = rng.randint(1, 30)
    arrive = [0 if rng.random() < 0.4 else rng.randint(1, NEW - 1) for _ in range(n)]
    reached = [threading.Event() for _ in range(NEW + 1)]
    reached[0].set()

    def on_token(step) -> None:
        reached[min(step.index + 1, NEW)].set()
    needle = _needle(model, captures, on_token)
    others = [_other(model, rng) for _ in range(n)]
    barrier, errors = StepBarrier(max_rows=32), []
    gate = threading.Barrier(1 + arrive.count(0))      # those that start with the needle start together

    def work(run: GenerationRun, at: int) -> None:
        try:
            assert reached[at].wait(60), "the needle never reached its step"
            if at == 0:
                gate.wait(60)
            barrier.drive(run)
        except Exception as e:      # noqa: BLE001  (raised below, in the test's thread)
            errors.append(e)
    threads = [threading.Thread(target=work, args=(r, a)) for r, a in [(needle, 0), *zip(others, arrive)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return needle, (needle.batched_steps, needle.packed_prefill)


def _captures_equal(a: GenerationRun, b: GenerationRun) -> bool:
    ca, cb = a.probe.recording.captures, b.probe.recording.captures
    return len(ca) == len(cb) > 0 and all(
        (x.name, x.step) == (y.name, y.step) and torch.equal(x.value, y.value) for x, y in zip(ca, cb))


@pytest.fixture(scope="module")
def models(tiny_model, tiny_model_dir):
    """dtype -> the tiny Llama in it (float32: the session's; the 16-bit ones loaded once here)."""
    from engine import load_model
    return {"float32": tiny_model, **{d: load_model(tiny_model_dir, device="cpu", dtype=d)
                                      for d in ("bfloat16", "float16")}}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("path", ["native", "pytorch"])
def test_a_run_is_bit_identical_to_itself_alone_inside_random_batches(models, path, dtype):
    """In each dtype the CPU computes (16-bit weights and activations, float32 sums: engine.matmul's tiles and the
    native kernels' row order hold in each)."""
    tiny_model = models[dtype]
    if path == "native":
        model = tiny_model
        assert model.accelerator.decode is not None, model.accelerator.why_not
        captures = False          # a capture of a stage other than the logits leaves the native step
    else:
        model, captures = tiny_model.with_accelerator(PLAIN), True
    alone = _needle(model, captures)
    alone.run()
    rng, identical, shared, batched, packed = random.Random(46), 0, 0, 0, 0
    for trial in range(TRIALS):
        got, (steps, pack) = _in_batch(model, captures, rng)
        shared += steps > 0 or pack
        batched, packed = batched + steps, packed + pack
        t = compare(alone, got)
        identical += t.bit_identical and (not captures or _captures_equal(alone, got))
    # which forwards the needle shares depends on when the threads come to the barrier: most trials share some
    assert shared >= TRIALS // 2 and batched and packed, (shared, batched, packed)
    assert identical == TRIALS, f"{identical} of {TRIALS} trials bit-identical to the run alone ({path}, {dtype})"


def _stats(backend, x: torch.Tensor, masked: bool = False) -> torch.Tensor:
    batcher = StatsBatcher(backend)
    batcher.add("logits", None, x, masked)
    return torch.cat([block.values[0] for block in batcher.take(0, 0)])


@pytest.mark.parametrize("backend", [REFERENCE, PYTORCH, NATIVE, chain(NATIVE, PYTORCH)], ids=lambda b: b.name)
@pytest.mark.parametrize("n", [64, 49152])         # a decode row of the tiny model's width; of its logits
def test_a_rows_statistics_do_not_depend_on_the_rows_beside_it(backend, n):
    g = torch.Generator().manual_seed(5)
    row = torch.randn(1, n, generator=g) * 3 + 0.5
    others = torch.randn(5, n, generator=g)
    others[1, 7] = float("nan")
    others[2, 3] = float("inf")
    others[3] += 1e4                   # mean >> spread: the moments decline it
    for masked in (False, True):
        alone = _stats(backend, row, masked)
        for at in (0, 2, 5):
            batch = torch.cat([others[:at], row, others[at:]])
            assert torch.equal(_stats(backend, batch, masked)[at], alone[0]), (backend.name, n, masked, at)
