"""Kernel benchmark: SparQ decode attention and ReAttention selection.

    python -m benchmarks.kernels_bench            # full sweep on CUDA, smoke run on CPU
    python -m benchmarks.kernels_bench --quick    # fewer configurations
    python -m benchmarks.kernels_bench --sparq-only   # skip the ReAttention table
    python -m benchmarks.kernels_bench --tune [--baseline PATH]   # SparQ block sizes and warps

SparQ: one decode step (one query per sequence), our default model's attention shape (9 query
heads sharing 3 KV heads, head dim 64), float16, k=128, r=16 (plus r=8, 32 at the largest
shape), l=32 (l = k/4, paper Table J1).
Compared: dense ``scaled_dot_product_attention`` (the faster of two GQA calls, see ``dense``),
the SparQ torch reference, and the Triton kernels with K stored once and twice (App. I).
ReAttention: selection for one query (B=1, same heads), paper settings (global 32, local 4096,
span 32, k'=127), peak extra GPU memory and time of the kernel vs the torch reference.
Prints markdown tables. Times are medians of ``triton.testing.do_bench`` (L2 flushed per call);
the Triton SparQ step is timed as a CUDA-graph replay (see ``graph_ms``), dense SDPA as the
faster of eager and graph.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch
import torch.nn.functional as F

from kernels.reattention import reattention_select_reference
from kernels.reattention_triton import reattention_select_triton
from kernels.sparq import sparq_attention_reference, sparq_transfer_bytes
from kernels.sparq_triton import sparq_attention_triton, triton_enabled

H_Q, H_KV, D = 9, 3, 64
K_SEL, R, L_WIN = 128, 16, 32
RE = dict(global_size=32, local_size=4096, span=32, topk=127)


def time_ms(fn, cuda):
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()  # CPU smoke run: a few wall-clock repeats
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def graph_ms(fn):
    """Time ``fn`` replayed from a CUDA graph: what a decode loop that captures its step pays
    (a SparQ step is 5 kernel launches, so eager timings at small sizes measure the host)."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def dense_grouped(q, K, V):
    """Dense GQA decode as one SDPA call: the G query heads of a KV head act as G query rows."""
    B, H_q, d = q.shape
    qg = q.view(B, K.shape[1], H_q // K.shape[1], d)
    return F.scaled_dot_product_attention(qg, K, V).view(B, H_q, d)


def dense_enable_gqa(q, K, V):
    return F.scaled_dot_product_attention(q[:, :, None], K, V, enable_gqa=True)[:, :, 0]


def make(B, S, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H_Q, D, generator=g, device=device, dtype=dtype)
    K = torch.randn(B, H_KV, S, D, generator=g, device=device, dtype=dtype)
    V = torch.randn(B, H_KV, S, D, generator=g, device=device, dtype=dtype)
    return q, K, V, V.float().mean(2).to(dtype)


def bench_sparq(configs, device, dtype, use_triton):
    """configs: (S, B, r) triples."""
    cuda = device == "cuda"
    rows = []
    for S, B, r in configs:
        q, K, V, vm = make(B, S, dtype, device)
        K_t = K.transpose(-1, -2).contiguous()
        args = (q, K, V, vm, K_SEL, r, L_WIN)
        t_dense = {}
        for name, fn in (("grouped", dense_grouped), ("enable_gqa", dense_enable_gqa)):
            try:
                t_dense[name] = time_ms(lambda: fn(q, K, V), cuda)
                if cuda:
                    t_dense[name + " (graph)"] = graph_ms(lambda: fn(q, K, V))
            except Exception:  # older torch without enable_gqa
                pass
        best = min(t_dense, key=t_dense.get)
        t_ref = time_ms(lambda: sparq_attention_reference(*args, return_scores=False), cuda)
        row = dict(S=S, B=B, r=r, dense=t_dense[best], dense_how=best, ref=t_ref)
        if use_triton:
            tri1 = lambda: sparq_attention_triton(*args, return_scores=False)  # noqa: E731
            tri2 = lambda: sparq_attention_triton(*args, K_t=K_t, return_scores=False)  # noqa: E731
            row["tri2_eager"] = time_ms(tri2, cuda)
            row["tri1"] = graph_ms(tri1) if cuda else time_ms(tri1, cuda)
            row["tri2"] = graph_ms(tri2) if cuda else row["tri2_eager"]
            ref = sparq_attention_reference(*args)
            got = sparq_attention_triton(*args, K_t=K_t)
            row["agree"] = (got.positions == ref.positions).float().mean().item()
            row["err"] = (got.out.float() - ref.out.float()).abs().max().item()
        row["transfer"] = sparq_transfer_bytes(S, D, K_SEL, r)["ratio"]
        rows.append(row)
        del q, K, V, vm, K_t
        if cuda:
            torch.cuda.empty_cache()
    return rows


def print_sparq(rows, use_triton):
    print(f"\n### SparQ decode attention (H_q={H_Q}, H_kv={H_KV}, d={D}, k={K_SEL}, "
          f"l={L_WIN}; times in ms)\n")
    head = "| S | B | r | dense SDPA | SparQ torch ref |"
    line = "|---:|---:|---:|---:|---:|"
    if use_triton:
        head += (" SparQ Triton 1xK | SparQ Triton 2xK | 2xK eager | speed-up 1xK | speed-up 2xK"
                 " | App. C transfer | positions = ref | max abs err |")
        line += "---:|---:|---:|---:|---:|---:|---:|---:|"
    else:
        head += " App. C transfer |"
        line += "---:|"
    print(head)
    print(line)
    for r in rows:
        s = f"| {r['S']} | {r['B']} | {r['r']} | {r['dense']:.3f} | {r['ref']:.3f} |"
        if use_triton:
            s += (f" {r['tri1']:.3f} | {r['tri2']:.3f} | {r['tri2_eager']:.3f} |"
                  f" {r['dense'] / r['tri1']:.2f}x |"
                  f" {r['dense'] / r['tri2']:.2f}x | {r['transfer']:.3f} | {r['agree'] * 100:.1f}% |"
                  f" {r['err']:.1e} |")
        else:
            s += f" {r['transfer']:.3f} |"
        print(s)
    hows = sorted({r["dense_how"] for r in rows})
    print(f"\ndense SDPA = fastest of: grouped query rows / enable_gqa, eager / CUDA graph "
          f"(picked: {', '.join(hows)}).")
    if use_triton:
        print("SparQ Triton 1xK / 2xK: CUDA-graph replay of one step, K stored once / also as K_t "
              "(App. I); '2xK eager': the same call launched from Python. Speed-up = dense / Triton.")


def peak_extra_bytes(fn, cuda):
    if not cuda:
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_reattention(seqs, device, dtype, use_triton, per_head_ks):
    cuda = device == "cuda"
    rows = []
    for S in seqs:
        q, K, _, _ = make(1, S, dtype, device, seed=1)
        for kh in per_head_ks:
            args = (q, K, RE["global_size"], RE["local_size"], RE["span"], RE["topk"], kh)
            row = dict(S=S, kh=kh or RE["topk"])
            row["ref_mem"] = peak_extra_bytes(lambda: reattention_select_reference(*args), cuda)
            row["ref_ms"] = time_ms(lambda: reattention_select_reference(*args), cuda)
            if use_triton:
                row["tri_mem"] = peak_extra_bytes(lambda: reattention_select_triton(*args), cuda)
                row["tri_ms"] = time_ms(lambda: reattention_select_triton(*args), cuda)
                a, b = reattention_select_reference(*args), reattention_select_triton(*args)
                row["same"] = torch.equal(a.positions, b.positions) and torch.equal(a.centres, b.centres)
            rows.append(row)
        del q, K
        if cuda:
            torch.cuda.empty_cache()
    return rows


def print_reattention(rows, use_triton):
    print(f"\n### ReAttention selection, B=1, H_q={H_Q}, H_kv={H_KV}, d={D}, global "
          f"{RE['global_size']}, local {RE['local_size']}, span {RE['span']}, k'={RE['topk']}\n")
    head = "| S | per-head k | torch ref peak extra MiB | torch ref ms |"
    line = "|---:|---:|---:|---:|"
    if use_triton:
        head += " Triton peak extra MiB | Triton ms | memory ratio | same selection |"
        line += "---:|---:|---:|---:|"
    print(head)
    print(line)
    def mib(x):
        return "n/a" if x != x else f"{x / 2 ** 20:.2f}"  # NaN on CPU: no allocator statistics

    for r in rows:
        s = f"| {r['S']} | {r['kh']} | {mib(r['ref_mem'])} | {r['ref_ms']:.3f} |"
        if use_triton:
            ratio = r["ref_mem"] / max(r["tri_mem"], 1)
            s += (f" {mib(r['tri_mem'])} | {r['tri_ms']:.3f} |"
                  f" {'n/a' if ratio != ratio else f'{ratio:.1f}x'} | {'yes' if r['same'] else 'NO'} |")
        print(s)
    print("\npeak extra = max_memory_allocated during the call minus what was allocated before "
          "(inputs excluded).")


def _profile_graph(fn, reps=20):
    """Mean GPU time per kernel (us) over graph replays of ``fn``, by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times[ev.name] = times.get(ev.name, 0.0) + ev.time_range.elapsed_us() / reps
    return {k: v for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def tune_sparq(baseline=None, best_out=None, S=16384, B=64, r=R):
    """Block sizes and warps of the Triton SparQ step at one shape (float16, K_t given):
    CUDA-graph replay time, agreement with the reference, registers and spills, and a per-kernel
    profile of the fastest (and of the baseline, a sparq_triton.py given by path)."""
    from kernels import sparq_triton as sparq

    cuda = torch.cuda.is_available()  # CPU (TRITON_INTERPRET=1): a dry run of this function
    dev, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    q, K, V, vm = make(B, S, dtype, dev)
    K_t = K.transpose(-1, -2).contiguous()
    args = (q, K, V, vm, K_SEL, r, L_WIN)
    ref = sparq_attention_reference(*args)
    t_dense = min(graph_ms(lambda: dense_grouped(q, K, V)), graph_ms(lambda: dense_enable_gqa(q, K, V)))
    print(f"tune: S={S} B={B} r={r} k={K_SEL} l={L_WIN} fp16; dense SDPA (graph) {t_dense * 1e3:.1f} us")
    if baseline:
        spec = importlib.util.spec_from_file_location("sparq_baseline", baseline)
        base = importlib.util.module_from_spec(spec)
        sys.modules["sparq_baseline"] = base  # dataclasses look their module up
        spec.loader.exec_module(base)
        for name, kt in (("2xK", K_t), ("1xK", None)):
            t = graph_ms(lambda: base.sparq_attention_triton(*args, K_t=kt, return_scores=False))
            print(f"baseline {name}: {t * 1e3:.1f} us  ({t_dense / t:.2f}x)")
        prof = _profile_graph(lambda: base.sparq_attention_triton(*args, K_t=K_t, return_scores=False))
        print("  baseline 2xK profile (us):", {k[:28]: round(v, 1) for k, v in prof.items()})
    saved = dict(sparq._LAUNCH)
    # (step-1 positions per program, its warps, selection chunk, its warps): the H100 sweep of
    # docs/performance.md, which also says why there is no fused one-kernel schedule (218 us here).
    configs = [dict(block_s=bs, step1_warps=w1, select_max=sm, select_warps=ws)
               for bs, w1, sm, ws in ((1024, 4, 2048, 4), (2048, 4, 2048, 4), (2048, 8, 2048, 4),
                                      (1024, 4, 1024, 2), (1024, 4, 2048, 2), (1024, 4, 4096, 4),
                                      (1024, 4, 4096, 8), (1024, 4, 1024, 4))]
    results = []
    for cfg in configs:
        sparq._LAUNCH.clear()
        sparq._LAUNCH.update(saved)
        sparq._LAUNCH.update(cfg)
        try:
            got = sparq_attention_triton(*args, K_t=K_t)
            same = torch.equal(got.positions, ref.positions)
            err = (got.out.float() - ref.out.float()).abs().max().item()
            aerr = (got.alpha - ref.alpha).abs().max().item()
            serr = (got.scores - ref.scores).abs().max().item()
            t = graph_ms(lambda: sparq_attention_triton(*args, K_t=K_t, return_scores=False))
            regs = {k: (getattr(v, "n_regs", "?"), getattr(v, "n_spills", "?"))
                    for k, v in sparq._LAST.items()}
            if same and err < 1e-3:
                results.append((t, cfg))
            print(f"{t * 1e3:7.1f} us {t_dense / t:5.2f}x same={same} err={err:.1e} "
                  f"alpha={aerr:.1e} scores={serr:.1e} regs/spills={regs} {cfg}", flush=True)
        except Exception as exc:  # a configuration that does not compile or fit
            print(f"FAILED {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    if best_out and results:
        with open(best_out, "w") as f:
            json.dump(min(results, key=lambda x: x[0])[1], f)
    if results:
        t, cfg = min(results, key=lambda x: x[0])
        sparq._LAUNCH.clear()
        sparq._LAUNCH.update(saved)
        sparq._LAUNCH.update(cfg)
        prof = _profile_graph(lambda: sparq_attention_triton(*args, K_t=K_t, return_scores=False))
        print(f"best: 2xK {t * 1e3:.1f} us ({t_dense / t:.2f}x) {cfg}")
        print("  profile (us):", {k[:28]: round(v, 1) for k, v in prof.items()})
    sparq._LAUNCH.clear()
    sparq._LAUNCH.update(saved)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    ap.add_argument("--sparq-only", action="store_true", help="skip the ReAttention table")
    ap.add_argument("--tune", action="store_true", help="SparQ block-size / warps sweep (CUDA)")
    ap.add_argument("--baseline", help="with --tune: a sparq_triton.py to time as the baseline")
    ap.add_argument("--best-out", help="with --tune: write the fastest settings here (JSON)")
    ap.add_argument("--launch", help="JSON file of kernels.sparq_triton._LAUNCH settings to use")
    opts = ap.parse_args()
    if opts.launch:
        from kernels import sparq_triton as sparq

        sparq._LAUNCH.update(json.load(open(opts.launch)))
        print("SparQ launch settings:", sparq._LAUNCH)
    if opts.tune:
        tune_sparq(opts.baseline, opts.best_out)
        return
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()} (CUDA)")
        dtype = torch.float16
        seqs = [1024, 4096, 16384]
        batches = [1, 64] if opts.quick else [1, 16, 64]
        extra = [] if opts.quick else [(16384, 64, 8), (16384, 64, 32)]
        re_seqs = [16384, 131072] if opts.quick else [16384, 65536, 262144]
    else:
        print("device: CPU (no CUDA): smoke run on tiny shapes; timings are not meaningful")
        dtype = torch.float32
        seqs, batches, extra, re_seqs = [512, 1024], [1, 2], [], [4096 + 600]
    use_triton = triton_enabled(torch.empty(0, device=device))
    if not use_triton:
        print("Triton kernels skipped (no CUDA and TRITON_INTERPRET is not 1)")
    configs = [(S, B, R) for S in seqs for B in batches] + extra
    rows = bench_sparq(configs, device, dtype, use_triton)
    print_sparq(rows, use_triton)
    if opts.sparq_only:
        return
    re_rows = bench_reattention(re_seqs, device, dtype, use_triton, [None, 4])
    print_reattention(re_rows, use_triton)


if __name__ == "__main__":
    main()
