"""Invariant paged attention vs torch's flash kernels on the H200.

Prefill: ours (paged, fixed tile/split order) vs torch varlen flash attention
and SDPA (flash backend) on contiguous q/k/v. Decode: ours (paged) vs varlen
flash with one query per sequence on contiguous KV (its best case).
Also checks that decode == prefill bit for bit for the last token (ours).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from vllm.kernels.attention import paged_attention_triton as paged_attention

H, HKV, D, BS = 32, 8, 128, 16


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def make_cache(lens, dtype=torch.bfloat16):
    blocks = [-(-n // BS) for n in lens]
    total = sum(blocks) + 1
    kc = torch.randn(total, BS, HKV, D, device="cuda", dtype=dtype)
    vc = torch.randn(total, BS, HKV, D, device="cuda", dtype=dtype)
    perm = torch.randperm(total - 1, device="cuda") + 1
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    off = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[off:off + b]
        off += b
    return kc, vc, table


def gather(kc, table, n, i):
    pos = torch.arange(n, device="cuda")
    return kc[table[i, pos // BS].long(), pos % BS]


def main() -> None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    scale = D ** -0.5
    rows = []
    for n_seqs, L in [(8, 512), (4, 2048), (2, 4096), (1, 8192)]:
        lens = [L] * n_seqs
        kc, vc, table = make_cache(lens)
        q = torch.randn(n_seqs * L, H, D, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, n_seqs + 1, device="cuda", dtype=torch.int32) * L
        sl = torch.tensor(lens, device="cuda", dtype=torch.int32)
        ours = bench(lambda: paged_attention(q, kc, vc, table, cu, sl, scale, max_query_len=L, max_seq_len=L))
        k = torch.cat([gather(kc, table, L, i) for i in range(n_seqs)])
        v = torch.cat([gather(vc, table, L, i) for i in range(n_seqs)])
        flash = bench(lambda: varlen_attn(q, k, v, cu, cu, L, L, scale=scale, window_size=(-1, 0))) if varlen_attn else float("nan")
        qs, ks, vs = (t.view(n_seqs, L, -1, D).transpose(1, 2) for t in (q, k, v))
        sdpa = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True))
        flops = 4 * n_seqs * L * L / 2 * H * D
        rows.append(("prefill", f"{n_seqs}x{L}", ours, flash, sdpa, f"{flops / ours / 1e6:.0f} TF/s"))
        # decode of the last token == prefill's last row, bit for bit
        full = paged_attention(q, kc, vc, table, cu, sl, scale, max_query_len=L, max_seq_len=L)
        last = q.view(n_seqs, L, H, D)[:, -1].contiguous()
        dec = paged_attention(last, kc, vc, table, torch.arange(n_seqs + 1, device="cuda", dtype=torch.int32), sl, scale,
                              max_query_len=1, max_seq_len=L)
        same = torch.equal(dec.view(torch.int16), full.view(n_seqs, L, H, D)[:, -1].contiguous().view(torch.int16))
        rows[-1] = rows[-1] + (f"decode==prefill: {same}",)
    for n_seqs, L in [(256, 512), (256, 2048), (64, 8192), (8, 32768)]:
        lens = [L] * n_seqs
        kc, vc, table = make_cache(lens)
        q = torch.randn(n_seqs, H, D, device="cuda", dtype=torch.bfloat16)
        cuq = torch.arange(n_seqs + 1, device="cuda", dtype=torch.int32)
        sl = torch.tensor(lens, device="cuda", dtype=torch.int32)
        ours = bench(lambda: paged_attention(q, kc, vc, table, cuq, sl, scale, max_query_len=1, max_seq_len=L))
        flash = float("nan")
        if varlen_attn is not None and n_seqs * L <= 256 * 8192:
            k = torch.cat([gather(kc, table, L, i) for i in range(n_seqs)])
            v = torch.cat([gather(vc, table, L, i) for i in range(n_seqs)])
            cuk = torch.arange(0, n_seqs + 1, device="cuda", dtype=torch.int32) * L
            flash = bench(lambda: varlen_attn(q, k, v, cuq, cuk, 1, L, scale=scale, window_size=(-1, 0)))
            del k, v
        kv_bytes = 2 * n_seqs * L * HKV * D * 2
        rows.append(("decode", f"{n_seqs}x{L}", ours, flash, float("nan"), f"{kv_bytes / ours / 1e6:.2f} TB/s", ""))
        del kc, vc
    print("\n== attention (us; ratio = torch flash varlen time / ours)")
    print(f"{'kind':8}{'shape':>12}{'ours':>10}{'flash':>10}{'sdpa':>10}{'ratio':>8}  {'rate':>12}")
    for kind, shape, ours, flash, sdpa, rate, note in rows:
        print(f"{kind:8}{shape:>12}{ours:10.1f}{flash:10.1f}{sdpa:10.1f}{flash / ours:8.2f}  {rate:>12} {note}")


if __name__ == "__main__":
    main()
