"""Tests for vllm.sample: counter-based RNG, batch-invariant sampling and logprobs.

Parity checks compare bit patterns (float32 viewed as int32) and exact integer
ids; allclose is used only where a value is checked against a float64 reference.
Every test runs on CPU and, when one is present, on CUDA.
"""
import math
import random
from dataclasses import replace

import pytest
import torch

from vllm.sample import (
    LOGPROBS_MODES,
    Sampler,
    SamplingBatch,
    batch_invariant_log_softmax,
    gumbel_noise,
    stable_topk,
    tempered_logprobs,
    uniform_noise,
)
from vllm.sample.sampler import _inclusive_scan, _pairwise_sum, apply_temperature

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SAMPLER = Sampler()


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """Run this module's many small CPU ops single-threaded.

    On a busy 2-core box, intra-op threads spinning on tiny tensors made these
    tests ~40x slower.  Multi-threaded CPU execution is covered on purpose by
    test_cpu_multithreaded_row_invariance.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float32 tensor (so -0.0 != 0.0 and NaNs compare by payload)."""
    assert t.dtype == torch.float32
    return t.contiguous().view(torch.int32).cpu()


def assert_close(actual, expected, rtol, atol):
    """|actual - expected| <= atol + rtol * |expected| (float64), equal infinities allowed.

    (torch.testing.assert_close costs seconds of import time on first use.)
    """
    a, e = actual.double().cpu(), expected.double().cpu()
    assert a.shape == e.shape
    same_inf = torch.isinf(a) & (a == e)
    err = torch.where(same_inf, torch.zeros_like(a), (a - e).abs())
    tol = atol + rtol * torch.where(same_inf, torch.zeros_like(e), e.abs())
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g}"


def make_batch(rows, device, max_num_logprobs=-1, mode="tempered_logprobs"):
    """rows: list of dicts with keys t, k, p, m, seed, pos."""
    return SamplingBatch.from_lists(
        [r["t"] for r in rows], [r["k"] for r in rows], [r["p"] for r in rows],
        [r["m"] for r in rows], [r["seed"] for r in rows], [r["pos"] for r in rows],
        device, max_num_logprobs=max_num_logprobs, logprobs_mode=mode)


def random_row_params(rng: random.Random):
    """A random, valid parameter set exercising every stage (and none)."""
    return dict(
        t=rng.choice([0.0, 0.3, 0.7, 1.0, 1.0, 1.5]),
        k=rng.choice([0, 0, 1, 5, 40, 10**6]),
        p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]),
        m=rng.choice([0.0, 0.0, 0.05, 0.3]),
        seed=rng.randrange(-2**63, 2**63),
        pos=rng.randrange(0, 5000),
    )


def sample_rows(logits, rows, **kw):
    return SAMPLER(logits, make_batch(rows, logits.device, **kw))


# --------------------------------------------------------------------------- #
# RNG
# --------------------------------------------------------------------------- #
# Pinned outputs: u * 2**24 for four (seed, position) rows and token ids 0..3.
# Integer-exact, so every device must reproduce them; a change here changes
# every seeded completion ever produced.
GOLDEN_SEEDS = [0, 1, -1, 2**62 + 12345]
GOLDEN_POSITIONS = [0, 0, 5, 2**40 + 3]
GOLDEN_U24 = [
    [1459649, 8614597, 12685209, 8069371],
    [14407535, 5891947, 11712889, 13598125],
    [13457043, 12503147, 5218031, 1614731],
    [8151181, 16125393, 13570541, 16120251],
]


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_noise_golden_values(device):
    u = uniform_noise(torch.tensor(GOLDEN_SEEDS), torch.tensor(GOLDEN_POSITIONS), 4, device)
    assert u.dtype == torch.float32 and u.device.type == device
    assert (u.double() * 2**24).long().cpu().tolist() == GOLDEN_U24


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_noise_range_grid_and_determinism(device):
    seeds = torch.tensor([3, 3, 4, -7, 2**63 - 1, -2**63])
    positions = torch.tensor([0, 1, 0, 9, 2**62, 0])
    V = 4099
    u = uniform_noise(seeds, positions, V, device)
    assert u.shape == (6, V)
    assert bool((u > 0).all()) and bool((u < 1).all())
    # Every value is an odd multiple of 2**-24.
    k = (u.double() * 2**24).cpu()
    assert bool((k == k.round()).all()) and bool((k.long() % 2 == 1).all())
    # Pure function of its inputs; chunking (by rows) never changes a bit.
    again = uniform_noise(seeds, positions, V, device, chunk_elems=V)
    assert torch.equal(bits(u), bits(again))
    # Different positions / seeds give unrelated noise.
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u[0] == u[1]).float().mean().item() < 0.01
    # The noise of a row alone equals its noise inside a batch.
    alone = uniform_noise(seeds[3:4], positions[3:4], V, device)
    assert torch.equal(bits(alone[0]), bits(u[3]))


def test_uniform_noise_statistics():
    u = uniform_noise(torch.full((64,), 11), torch.arange(64), 20000).double()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.bincount((u.flatten() * 100).long(), minlength=100).double()
    chi2 = (((counts - n / 100) ** 2) / (n / 100)).sum().item()
    assert chi2 < 99 + 6 * math.sqrt(2 * 99)
    # Neighbouring tokens and neighbouring positions are uncorrelated.
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        c = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(c) < 5 / math.sqrt(a.numel())


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_noise_finite(device):
    g = gumbel_noise(torch.arange(8), torch.zeros(8, dtype=torch.long), 1000, device)
    assert bool(torch.isfinite(g).all())
    assert abs(g.double().mean().item() - 0.5772156649) < 0.05  # Euler-Mascheroni


@pytest.mark.gpu
def test_uniform_noise_triton_equals_torch_on_cuda():
    seeds = torch.randint(-2**63, 2**63 - 1, (33,), device="cuda")
    positions = torch.randint(0, 2**40, (33,), device="cuda")
    fast = uniform_noise(seeds, positions, 70001, "cuda", impl="triton")
    ref = uniform_noise(seeds, positions, 70001, "cuda", impl="torch")
    assert torch.equal(bits(fast), bits(ref))


@pytest.mark.gpu
def test_uniform_noise_cpu_equals_cuda():
    seeds = torch.randint(-2**63, 2**63 - 1, (17,))
    positions = torch.randint(0, 10**6, (17,))
    cpu = uniform_noise(seeds, positions, 5003, "cpu")
    gpu = uniform_noise(seeds.cuda(), positions.cuda(), 5003, "cuda")
    assert torch.equal(bits(cpu), bits(gpu))


# --------------------------------------------------------------------------- #
# Batch-invariant numerics
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
def test_pairwise_sum_and_scan(device):
    torch.manual_seed(0)
    for n in (1, 2, 3, 7, 64, 1000, 1025):
        x = torch.rand(5, n, device=device)
        ref = x.double().sum(-1, keepdim=True)
        assert_close(_pairwise_sum(x).double(), ref, rtol=1e-6, atol=0)
        scan = _inclusive_scan(x)
        assert_close(scan.double(), x.double().cumsum(-1), rtol=1e-6, atol=0)
        # Column j of the scan does not depend on how long the row is.
        for m in (1, n // 2 + 1):
            assert torch.equal(bits(_inclusive_scan(x[:, :m])), bits(scan[:, :m]))


@pytest.mark.parametrize("device", DEVICES)
def test_log_softmax_matches_reference_and_is_row_local(device):
    torch.manual_seed(1)
    x = torch.randn(9, 3001, device=device) * 4
    x[2, :100] = float("-inf")
    out = batch_invariant_log_softmax(x)
    assert_close(out.double(), torch.log_softmax(x.double(), -1), rtol=0, atol=1e-5)
    for i in range(9):
        assert torch.equal(bits(batch_invariant_log_softmax(x[i:i + 1].clone())[0]), bits(out[i]))
    # Any leading shape; per-row temperatures; T == 0 means T = 1.
    t = torch.tensor([0.5, 0.0, 2.0], device=device)
    x3 = x[:6].reshape(3, 2, 3001)
    lp = tempered_logprobs(x3, t.unsqueeze(1).expand(3, 2))
    assert torch.equal(bits(lp[1, 0]), bits(batch_invariant_log_softmax(x3[1, 0:1])[0]))
    assert torch.equal(bits(lp[2, 1]), bits(tempered_logprobs(x3[2, 1:2], 2.0)[0]))


def test_cpu_multithreaded_row_invariance():
    """With several intra-op threads, work splits fall mid-row at batch-dependent
    offsets; elementwise results (exp/log included) must not depend on that."""
    saved = torch.get_num_threads()
    torch.set_num_threads(max(2, saved))
    try:
        torch.manual_seed(15)
        V = 40009  # one row is already past torch's parallel grain size
        x = torch.randn(9, V) * 3
        seeds, positions = torch.arange(9) * 1000003, torch.arange(9) + 5
        lsm = batch_invariant_log_softmax(x)
        g = gumbel_noise(seeds, positions, V)
        for i in (0, 4, 8):
            assert torch.equal(bits(batch_invariant_log_softmax(x[i:i + 1].clone())[0]), bits(lsm[i]))
            assert torch.equal(bits(gumbel_noise(seeds[i:i + 1], positions[i:i + 1], V)[0]), bits(g[i]))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_temperature_is_true_division(device):
    x = torch.randn(4, 333, device=device)
    t = torch.tensor([0.7, 0.0, 1.3, 1.0], device=device)
    out = apply_temperature(x, t)
    ref = torch.stack([x[0] / torch.tensor(0.7, device=device), x[1],
                       x[2] / torch.tensor(1.3, device=device), x[3]])
    assert torch.equal(bits(out), bits(ref))
    assert torch.equal(bits(out[1]), bits(x[1]))  # greedy rows keep raw logits exactly


@pytest.mark.parametrize("device", DEVICES)
def test_stable_topk_equals_stable_sort_prefix(device):
    torch.manual_seed(2)
    x = torch.randint(-3, 4, (7, 500), device=device).float()  # many ties
    x[1, 10:] = float("-inf")
    x[4:] = torch.randn(3, 500, device=device)  # no ties: topk's own set is used
    x[6, 100:110] = x[6, 5]  # ties inside the top set, not at the boundary for small k
    full_v, full_i = torch.sort(x, dim=-1, descending=True, stable=True)
    for k in (1, 3, 17, 250, 499, 500, 600):
        v, i = stable_topk(x, k)
        kk = min(k, 500)
        assert torch.equal(i.cpu(), full_i[:, :kk].cpu())
        assert torch.equal(bits(v), bits(full_v[:, :kk]))


# --------------------------------------------------------------------------- #
# Sampling
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
def test_seeded_reproducibility(device):
    torch.manual_seed(3)
    logits = torch.randn(1, 1000, device=device).expand(64, -1).contiguous() * 0.1
    rows = [dict(t=1.0, k=0, p=1.0, m=0.0, seed=1234, pos=i) for i in range(64)]
    a = sample_rows(logits, rows).token_ids
    b = sample_rows(logits, rows).token_ids
    assert torch.equal(a.cpu(), b.cpu())
    # Same seed, different positions: different draws from a flat distribution.
    assert len(set(a.tolist())) > 50
    # Same position, different seed: different draw (with overwhelming probability).
    other = [dict(r, seed=4321) for r in rows]
    assert (sample_rows(logits, other).token_ids != a).float().mean().item() > 0.9


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_batch_invariance_bits(device, mode):
    """Row i alone == row i at several positions inside batches of random others."""
    rng = random.Random(LOGPROBS_MODES.index(mode))
    torch.manual_seed(4)
    V = 4001  # not a multiple of any vector width
    num_top = 6
    pool_logits = torch.randn(24, V, device=device) * 3
    pool_logits[3, :5] = pool_logits[3, 5]            # ties at the top
    pool_logits[18, ::7] = float("-inf")              # pre-masked tokens
    pool_params = [random_row_params(rng) for _ in range(24)]
    # Rows sampled alone below are 0, 3, ..., 21: give them every interesting combination.
    pool_params[0].update(t=0.0, k=0, p=1.0, m=0.0)
    pool_params[3].update(t=1.0, k=3, p=1.0, m=0.0)
    pool_params[6].update(t=0.8, k=20, p=0.8, m=0.1)
    pool_params[9].update(t=1.0, k=0, p=1.0, m=0.0)
    pool_params[12].update(t=1.2, k=0, p=0.7, m=0.0)
    pool_params[15].update(t=0.9, k=0, p=1.0, m=0.2)
    pool_params[18].update(t=0.6, k=50, p=0.95, m=0.0)

    for i in range(0, 24, 3):
        alone = sample_rows(pool_logits[i:i + 1].clone(), [pool_params[i]],
                            max_num_logprobs=num_top, mode=mode)
        for batch_size in (2, 6, 13):
            others = rng.sample([j for j in range(24) if j != i], batch_size - 1)
            for where in {0, batch_size // 2, batch_size - 1}:
                order = others[:where] + [i] + others[where:]
                out = sample_rows(pool_logits[order], [pool_params[j] for j in order],
                                  max_num_logprobs=num_top, mode=mode)
                assert out.token_ids[where].item() == alone.token_ids[0].item()
                assert bits(out.logprobs[where]).item() == bits(alone.logprobs[0]).item()
                assert out.ranks[where].item() == alone.ranks[0].item()
                assert torch.equal(out.topk_ids[where].cpu(), alone.topk_ids[0].cpu())
                assert torch.equal(bits(out.topk_logprobs[where]), bits(alone.topk_logprobs[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_token_is_argmax_of_tempered_logits_plus_gumbel(device):
    """The documented formula, bit for bit: argmax over kept tokens of x / T + g."""
    torch.manual_seed(16)
    V = 1000
    logits = torch.randn(5, V, device=device) * 2
    rows = [dict(t=t, k=k, p=p, m=0.0, seed=31 * i - 7, pos=3 * i)
            for i, (t, k, p) in enumerate([(0.5, 0, 1.0), (1.0, 0, 1.0), (1.7, 0, 1.0), (1.0, 10, 1.0), (0.8, 0, 0.7)])]
    out = sample_rows(logits, rows)
    t = torch.tensor([r["t"] for r in rows], device=device)
    g = gumbel_noise(torch.tensor([r["seed"] for r in rows]), torch.tensor([r["pos"] for r in rows]), V, device)
    kept = torch.isfinite(_reference_dist(logits, rows, "processed_logits")).to(device)
    scores = (apply_temperature(logits, t) + g).masked_fill(~kept, float("-inf"))
    assert out.token_ids.tolist() == scores.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_batch_invariance_fast_path_flags(device):
    """all_greedy / no_truncation fast paths give the same bits as the general path."""
    torch.manual_seed(5)
    logits = torch.randn(3, 777, device=device)
    plain = [dict(t=0.0, k=0, p=1.0, m=0.0, seed=i, pos=0) for i in range(3)]
    for mode in LOGPROBS_MODES:
        fast_batch = make_batch(plain, device, 3, mode)
        # the fast path really is taken: the batch promises both, with host values
        assert fast_batch.all_greedy and fast_batch.no_truncation and fast_batch.host_params is not None
        fast = SAMPLER(logits, fast_batch)
        # the general path: no promises and no host values, so the sampler probes the device
        slow_batch = replace(make_batch(plain, device, 3, mode), all_greedy=False, no_truncation=False,
                             host_params=None)
        slow = SAMPLER(logits, slow_batch)
        assert torch.equal(fast.token_ids.cpu(), slow.token_ids.cpu())
        assert torch.equal(bits(fast.logprobs), bits(slow.logprobs))
        assert torch.equal(bits(fast.topk_logprobs), bits(slow.topk_logprobs))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_lowest_id_on_ties(device):
    torch.manual_seed(6)
    logits = torch.randn(6, 300, device=device)
    logits[2, [7, 50, 299]] = 100.0   # tie at the max -> id 7
    logits[4, :] = 0.0                # all tied -> id 0
    rows = [dict(t=0.0, k=rng_k, p=1.0, m=0.0, seed=i, pos=i) for i, rng_k in enumerate([0, 5, 0, 1, 0, 2])]
    out = sample_rows(logits, rows, max_num_logprobs=0)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.token_ids[2].item() == 7 and out.token_ids[4].item() == 0
    assert out.ranks.tolist() == [1] * 6


@pytest.mark.parametrize("device", DEVICES)
def test_ties_broken_deterministically(device):
    """Equal scores are resolved the same way every time, by token id."""
    logits = torch.zeros(2, 10, device=device)
    logits[:, 2:5] = 1.0  # three tied best tokens
    # top_k = 2 over a 3-way tie keeps ids 2 and 3 (lower ids win).
    rows = [dict(t=1.0, k=2, p=1.0, m=0.0, seed=s, pos=0) for s in range(400)]
    toks = sample_rows(logits[:1].expand(400, -1).contiguous(), rows).token_ids
    assert set(toks.tolist()) == {2, 3}
    # top_p that needs exactly one of the tied tokens keeps the lowest id.
    rows = [dict(t=1.0, k=0, p=0.01, m=0.0, seed=s, pos=0) for s in range(50)]
    toks = sample_rows(logits[:1].expand(50, -1).contiguous(), rows).token_ids
    assert set(toks.tolist()) == {2}


def support(logits, rows, draws=3000):
    """Set of token ids sampled over `draws` (seed, position) pairs for one logits row."""
    many = logits.expand(draws, -1).contiguous()
    rows = [dict(rows, seed=1000 + d, pos=d * 7) for d in range(draws)]
    return set(sample_rows(many, rows).token_ids.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_support(device):
    torch.manual_seed(7)
    logits = torch.randn(1, 200, device=device) * 0.3  # flat-ish
    expected = set(torch.sort(logits[0], descending=True, stable=True).indices[:5].tolist())
    assert support(logits, dict(t=1.0, k=5, p=1.0, m=0.0)) == expected


def _sorted_probs64(logits, t):
    p = torch.softmax(logits.double().cpu() / t, -1)[0]
    order = torch.sort(p, descending=True, stable=True).indices
    return p, order


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_support(device):
    torch.manual_seed(8)
    logits = torch.randn(1, 60, device=device)
    t, top_p = 0.9, 0.6
    p, order = _sorted_probs64(logits, t)
    cum = p[order].cumsum(0)
    n_keep = int((cum < top_p).sum().item()) + 1  # smallest prefix with mass >= top_p
    assert abs(cum[n_keep - 1].item() - top_p) > 1e-4  # not a rounding-sensitive boundary
    expected = set(order[:n_keep].tolist())
    assert support(logits, dict(t=t, k=0, p=top_p, m=0.0), draws=6000) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_then_top_p_support(device):
    torch.manual_seed(9)
    logits = torch.randn(1, 80, device=device)
    k, top_p = 10, 0.5
    p, order = _sorted_probs64(logits, 1.0)
    pk = p[order[:k]] / p[order[:k]].sum()  # top-p acts on the renormalised top-k
    cum = pk.cumsum(0)
    n_keep = int((cum < top_p).sum().item()) + 1
    expected = set(order[:n_keep].tolist())
    assert support(logits, dict(t=1.0, k=k, p=top_p, m=0.0), draws=6000) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_width_search_never_changes_results(device, monkeypatch):
    """The sorted-prefix width used for top-p is a speed knob only."""
    import vllm.sample.sampler as sampler_mod

    torch.manual_seed(14)
    logits = torch.randn(6, 3000, device=device) * 0.5  # flat: big nuclei
    rows = [dict(t=1.0, k=k, p=p, m=0.0, seed=i, pos=i)
            for i, (k, p) in enumerate([(0, 0.99), (0, 0.5), (700, 0.9), (0, 1.0), (40, 1.0), (0, 0.999)])]
    ref = sample_rows(logits, rows, max_num_logprobs=4, mode="processed_logprobs")
    for first_width in (1, 7, 64, 4096):
        monkeypatch.setattr(sampler_mod, "_TOP_P_FIRST_WIDTH", first_width)
        out = sample_rows(logits, rows, max_num_logprobs=4, mode="processed_logprobs")
        assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
        assert torch.equal(bits(out.logprobs), bits(ref.logprobs))
        assert torch.equal(bits(out.topk_logprobs), bits(ref.topk_logprobs))
        assert torch.equal(out.ranks.cpu(), ref.ranks.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_support(device):
    torch.manual_seed(10)
    logits = torch.randn(1, 100, device=device)
    t, min_p = 1.3, 0.25
    p, _ = _sorted_probs64(logits, t)
    ratio = p / p.max()
    assert bool(((ratio - min_p).abs() > 1e-4).all())
    expected = set(torch.nonzero(ratio >= min_p).flatten().tolist())
    assert support(logits, dict(t=t, k=0, p=1.0, m=min_p), draws=6000) == expected
    # The min-p-only path (no sort) and the sorted path agree bit for bit.
    rows = [dict(t=t, k=0, p=1.0, m=min_p, seed=s, pos=0) for s in range(4)]
    rows_sorted = [dict(r, k=99) for r in rows]  # k = 99 < V forces the sorted path, keeps all
    many = logits.expand(4, -1).contiguous()
    a = sample_rows(many, rows, max_num_logprobs=3, mode="processed_logprobs")
    b = sample_rows(many, rows_sorted, max_num_logprobs=3, mode="processed_logprobs")
    assert torch.equal(a.token_ids.cpu(), b.token_ids.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_comes_before_top_p(device):
    """Upstream's order: min-p removes tokens before top-p renormalises. Probabilities [.5,
    .2, .1, .1, .1] with min_p 0.3 leave {0} (0.2 < 0.3 x 0.5); top-p 0.7 over what is left
    keeps {0}. Top-p first would keep {0, 1} (0.5 < 0.7), which min-p then keeps too."""
    logits = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1]], device=device).log()
    assert support(logits, dict(t=1.0, k=0, p=0.7, m=0.3), draws=400) == {0}
    assert support(logits, dict(t=1.0, k=0, p=0.7, m=0.0), draws=400) == {0, 1}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_token_ban_leaves_the_reported_distribution(device, mode):
    """min_tokens' bans (TokenBan) take the banned tokens out of sampling, as a grammar mask
    does: the tempered and raw modes report the model's distribution bit for bit as without
    the ban (what the trainer recomputes; upstream's raw logprobs come before its logits
    processors), the processed modes the banned tokens at -inf."""
    from vllm.sample.sampler import TokenBan
    torch.manual_seed(13)
    logits = torch.randn(3, 50, device=device)
    logits[:, 7] = 10.0   # the banned token would win every draw
    rows = [dict(t=t, k=0, p=1.0, m=0.0, seed=s, pos=0) for t, s in ((0.0, 1), (0.8, 2), (1.0, 3))]
    free = SAMPLER(logits, make_batch(rows, device, max_num_logprobs=5, mode=mode))
    batch = make_batch(rows, device, max_num_logprobs=5, mode=mode)
    batch.token_ban = TokenBan(rows=torch.tensor([0, 1], device=device), token_ids=torch.tensor([7, 7], device=device))
    banned = SAMPLER(logits, batch)
    assert banned.token_ids[0].item() != 7 and banned.token_ids[1].item() != 7
    assert free.token_ids[2].item() == banned.token_ids[2].item() == 7
    dist = torch.stack([banned.topk_logprobs[i][banned.topk_ids[i] == 7].reshape(-1)[:1].cpu()
                        if (banned.topk_ids[i] == 7).any() else torch.tensor([float("nan")]) for i in range(3)])
    if mode.startswith("processed"):
        assert not (banned.topk_ids[:2] == 7).any()   # -inf: out of the top 5
    else:
        # the banned token keeps its value and its place at the top of the reported top-k
        assert (banned.topk_ids[:, 0] == 7).all()
        assert torch.equal(bits(banned.topk_logprobs), bits(free.topk_logprobs))
        assert torch.isfinite(dist).all()
        # the sampled token's value is the unbanned distribution's
        ref = SAMPLER(logits, make_batch(rows, device, max_num_logprobs=50, mode=mode))
        want = ref.topk_logprobs.gather(1, (ref.topk_ids == banned.token_ids[:, None]).int().argmax(1, keepdim=True))
        assert torch.equal(bits(banned.logprobs), bits(want[:, 0]))


@pytest.mark.parametrize("device", DEVICES)
def test_empirical_distribution_matches_softmax(device):
    torch.manual_seed(11)
    V, T, draws = 12, 0.8, 20000
    logits = torch.randn(1, V, device=device) * 1.5
    rows = [dict(t=T, k=0, p=1.0, m=0.0, seed=77, pos=d) for d in range(draws)]
    toks = sample_rows(logits.expand(draws, -1).contiguous(), rows).token_ids.cpu()
    counts = torch.bincount(toks, minlength=V).double()
    expected = torch.softmax(logits.double().cpu()[0] / T, -1) * draws
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 40.0  # 11 dof: p ~ 4e-5
    tv = 0.5 * (counts / draws - expected / draws).abs().sum().item()
    assert tv < 0.02


# --------------------------------------------------------------------------- #
# Logprobs
# --------------------------------------------------------------------------- #
def _reference_dist(logits, rows, mode):
    """float64 reference of each logprobs mode, truncation done independently."""
    out = []
    for i, r in enumerate(rows):
        x = logits[i].double().cpu()
        t = r["t"] if r["t"] > 0 else 1.0
        s = x / t
        if mode == "raw_logits":
            out.append(x)
            continue
        if mode == "raw_logprobs":
            out.append(torch.log_softmax(x, -1))
            continue
        if mode == "tempered_logprobs":
            out.append(torch.log_softmax(s, -1))
            continue
        # upstream's order: min-p, then top-k, then top-p over what is left
        keep = torch.ones_like(s, dtype=torch.bool)
        if r["m"] > 0:
            keep &= torch.softmax(s, -1) >= r["m"] * torch.softmax(s, -1).max()
        order = torch.sort(s, descending=True, stable=True).indices
        if 0 < r["k"] < len(s):
            keep[order[r["k"]:]] = False
        if r["p"] < 1.0:
            p = torch.softmax(s.masked_fill(~keep, -math.inf), -1)[order]
            before = p.cumsum(0) - p
            drop = before >= r["p"]
            drop[0] = False
            keep[order[drop]] = False
        proc = s.masked_fill(~keep, -math.inf)
        out.append(proc if mode == "processed_logits" else torch.log_softmax(proc, -1))
    return torch.stack(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logprob_modes_against_float64(device, mode):
    torch.manual_seed(12)
    V, k = 500, 8
    logits = torch.randn(5, V, device=device) * 2
    rows = [
        dict(t=0.0, k=0, p=1.0, m=0.0, seed=1, pos=0),
        dict(t=0.7, k=0, p=1.0, m=0.0, seed=2, pos=3),
        dict(t=1.0, k=30, p=1.0, m=0.0, seed=3, pos=1),
        dict(t=1.3, k=0, p=0.8, m=0.0, seed=4, pos=9),
        dict(t=0.9, k=50, p=0.9, m=0.05, seed=5, pos=2),
    ]
    out = sample_rows(logits, rows, max_num_logprobs=k, mode=mode)
    ref = _reference_dist(logits, rows, mode)
    tok = out.token_ids.cpu()
    ref_tok = ref.gather(1, tok.unsqueeze(1)).squeeze(1)
    assert bool(torch.isfinite(ref_tok).all())  # the sampled token always survives truncation
    assert_close(out.logprobs.double().cpu(), ref_tok, rtol=0, atol=2e-5)
    # Masked entries match exactly (-inf); the top-k values match the reference.
    ref_top = torch.sort(ref, dim=-1, descending=True, stable=True).values[:, :k]
    assert_close(out.topk_logprobs.double().cpu(), ref_top, rtol=0, atol=2e-5)
    if mode == "raw_logits":
        assert torch.equal(bits(out.logprobs), bits(logits.gather(1, out.token_ids.unsqueeze(1))[:, 0]))
    assert out.logprobs.dtype == torch.float32 and out.topk_logprobs.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_and_topk_exact(device):
    """Ranks and top-k against an exact Python recomputation on the returned distribution."""
    torch.manual_seed(13)
    V, k = 300, 10
    logits = torch.randint(-4, 5, (4, V), device=device).float()  # lots of ties
    rows = [dict(t=1.0, k=0, p=1.0, m=0.0, seed=i, pos=i) for i in range(4)]
    rows[3]["t"] = 0.0
    for mode in ("raw_logits", "tempered_logprobs"):
        out = sample_rows(logits, rows, max_num_logprobs=k, mode=mode)
        dist = logits if mode == "raw_logits" else batch_invariant_log_softmax(logits)
        for i in range(4):
            vals = dist[i].cpu().tolist()
            tok = out.token_ids[i].item()
            assert bits(out.logprobs[i]).item() == bits(dist[i, tok]).item()
            assert out.ranks[i].item() == 1 + sum(v > vals[tok] for v in vals)
            expect = sorted(range(V), key=lambda j: (-vals[j], j))[:k]
            assert out.topk_ids[i].tolist() == expect
            assert torch.equal(bits(out.topk_logprobs[i]), bits(dist[i, expect]))
    # Greedy rows: rank 1 and top-1 is the sampled token.
    assert out.ranks[3].item() == 1 and out.topk_ids[3, 0].item() == out.token_ids[3].item()


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_shapes_by_max_num_logprobs(device):
    logits = torch.randn(3, 50, device=device)
    rows = [dict(t=1.0, k=0, p=1.0, m=0.0, seed=i, pos=0) for i in range(3)]
    none = sample_rows(logits, rows)
    assert none.logprobs is None and none.ranks is None and none.topk_ids is None
    zero = sample_rows(logits, rows, max_num_logprobs=0)
    assert zero.logprobs.shape == (3,) and zero.ranks.shape == (3,) and zero.topk_ids is None
    many = sample_rows(logits, rows, max_num_logprobs=80)  # more than the vocab: clamped
    assert many.topk_ids.shape == (3, 50) and many.topk_logprobs.shape == (3, 50)
    assert torch.equal(many.token_ids.cpu(), none.token_ids.cpu())
    with pytest.raises(ValueError):
        sample_rows(logits, rows, max_num_logprobs=0, mode="bogus")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    logits = torch.empty(0, 100, device=device)
    out = sample_rows(logits, [])
    assert out.token_ids.shape == (0,) and out.token_ids.dtype == torch.int64
    out = sample_rows(logits, [], max_num_logprobs=4)
    assert out.logprobs.shape == (0,) and out.ranks.shape == (0,)
    assert out.topk_ids.shape == (0, 4) and out.topk_logprobs.shape == (0, 4)
    assert uniform_noise(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                         100, device).shape == (0, 100)


def test_host_plan_matches_device_probes_and_changes_no_bits():
    """from_lists keeps the parameters on the host so the sampler plans its stages without
    a host sync; the plan must be the one the device probes give (float32 comparisons,
    top_k >= vocab disabled, min_p clamped), and the outputs must not change by a bit."""
    from dataclasses import replace

    from vllm.sample.sampler import Sampler, _TruncationPlan
    vocab = 97
    g = torch.Generator().manual_seed(5)
    cases = [
        dict(temperature=[0.0, 1e-50, 0.5], top_k=[0, 97, 200], top_p=[0.99999999, 1.0, 1.5], min_p=[1e-50, 0.0, 2.0]),
        dict(temperature=[1.0, 0.0], top_k=[5, 0], top_p=[1.0, 0.3], min_p=[0.0, 0.0]),
        dict(temperature=[0.0, 0.0], top_k=[0, 0], top_p=[1.0, 1.0], min_p=[0.0, 0.0]),
        dict(temperature=[0.7] * 4, top_k=[3, 96, -1, 50], top_p=[0.8, 1.0, 0.95, 1.0], min_p=[0.0, 0.1, 0.0, 0.05]),
    ]
    for case in cases:
        n = len(case["temperature"])
        batch = SamplingBatch.from_lists(**case, seeds=list(range(n)), positions=[3] * n, device="cpu",
                                         max_num_logprobs=2)
        t, k = batch.temperature, batch.top_k
        p, m = batch.top_p, batch.min_p.clamp(max=1.0)
        use_k, use_p, use_m = (k > 0) & (k < vocab), p < 1.0, m > 0.0
        want = (bool((t <= 0).all()), _TruncationPlan(bool(use_k.any()), bool(use_p.any()), bool(use_m.any()),
                                                      bool((use_p & ~use_k).any()),
                                                      int(torch.where(use_k, k, torch.zeros_like(k)).max())))
        assert batch.host_params.plan(vocab) == want, case
        logits = torch.randn(n, vocab, generator=g)
        a = Sampler()(logits, batch)
        b = Sampler()(logits, replace(batch, host_params=None))
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.logprobs.view(torch.int32), b.logprobs.view(torch.int32))
        assert torch.equal(a.topk_ids, b.topk_ids)


def test_stable_topk_k1_is_the_first_maximum():
    """k = 1 takes argmax (no host sync): the lowest index among tied maxima, as the stable sort."""
    from vllm.sample.sampler import stable_topk
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -0.0, -1.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    vals, ids = stable_topk(x, 1)
    ref_vals, ref_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, ref_ids[:, :1]) and torch.equal(vals.view(torch.int32), ref_vals[:, :1].view(torch.int32))
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, 4, (64, 50), generator=g).float()
    vals, ids = stable_topk(y, 1)
    ref_vals, ref_ids = torch.sort(y, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, ref_ids[:, :1])


def test_fused_gumbel_argmax_matches_its_reference():
    """The fused noise + argmax kernel (under the Triton interpreter on CPU: numpy logs)
    against the same float32 ops written out: u, log(-log(u)), scaled - g, first argmax;
    ties and a vocabulary that is not a multiple of the block."""
    import os

    import numpy as np
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm.sample.rng import gumbel_argmax
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for B, V, block in ((3, 100, 64), (4, 3001, 512), (2, 1024, 1024)):
        scaled = (torch.randn(B, V, generator=g) * 3).to(dev)
        seeds = torch.randint(0, 2**40, (B,), generator=g)
        pos = torch.randint(0, 1000, (B,), generator=g)
        scores = torch.empty(B, V, device=dev)
        got = gumbel_argmax(scaled, seeds, pos, block=block, scores_out=scores)
        u = uniform_noise(seeds, pos, V, "cpu").numpy()
        ref_scores = scaled.cpu().numpy() - np.log(-np.log(u))
        if dev == "cpu":  # the interpreter's logs are numpy's: exact
            assert np.array_equal(scores.numpy().view(np.int32), ref_scores.astype(np.float32).view(np.int32))
        assert got.tolist() == scores.cpu().argmax(-1).tolist()
    # ties: equal scores everywhere pick the lowest id; a -inf row picks 0
    flat = torch.full((2, 300), float("-inf"), device=dev)
    assert gumbel_argmax(flat, torch.tensor([1, 2]), torch.tensor([0, 0]), block=128).tolist() == [0, 0]


@pytest.mark.gpu
def test_gpu_fused_gumbel_scores_bits():
    """Gate for KernelConfig.fused_gumbel: the fused kernel's scores must equal the unfused path's
    (uniform_noise, log_, neg_, log_, sub) bit for bit on this GPU, at the real vocab."""
    from vllm.sample.rng import gumbel_argmax
    torch.manual_seed(0)
    B, V = 64, 151936
    scaled = torch.randn(B, V, device="cuda") * 4
    seeds = torch.randint(-2**62, 2**62, (B,), device="cuda")
    pos = torch.randint(0, 10**5, (B,), device="cuda")
    fused_scores = torch.empty(B, V, device="cuda")
    ids = gumbel_argmax(scaled, seeds, pos, scores_out=fused_scores)
    ref = uniform_noise(seeds, pos, V, "cuda")
    ref.log_().neg_().log_()
    ref = torch.sub(scaled, ref)
    assert torch.equal(bits(fused_scores), bits(ref))
    assert torch.equal(ids, ref.argmax(-1))


def test_uniform_kernel_equals_torch_hash():
    """The Triton noise kernel's integer hash (row keys, mix, uniform map) equals the torch
    path bit for bit (on CPU through the Triton interpreter)."""
    from vllm.sample import rng
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # conftest sets TRITON_INTERPRET=1 without CUDA
    g = torch.Generator().manual_seed(11)
    seeds = torch.randint(-2**62, 2**62, (7,), generator=g).to(dev)
    positions = torch.randint(0, 2**40, (7,), generator=g).to(dev)
    ref = uniform_noise(seeds, positions, 3001, dev, impl="torch")
    out = torch.empty(7, 3001, device=dev)
    rng._uniform_kernel[(7, 3)](out, seeds, positions, 3001, out.stride(0), rng._MUL1, rng._MUL2,
                                rng._KEY_INIT_A, rng._KEY_INIT_B, BLOCK=1024)
    assert torch.equal(bits(out), bits(ref))


# --------------------------------------------------------------------------- #
# Presence / frequency / repetition penalties
# --------------------------------------------------------------------------- #
def _penalties(rows_hist, device):
    """rows_hist: {batch row: (presence, frequency, repetition, prompt ids, output ids)}."""
    from vllm.sample.sampler import Penalties
    rows = sorted(rows_hist)
    out_ids, out_slot, pr_ids, pr_slot = [], [], [], []
    for slot, r in enumerate(rows):
        _, _, _, prompt, output = rows_hist[r]
        out_ids += output
        out_slot += [slot] * len(output)
        pr_ids += prompt
        pr_slot += [slot] * len(prompt)
    t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)
    return Penalties(rows=t(rows, torch.long), presence=t([rows_hist[r][0] for r in rows], torch.float32),
                     frequency=t([rows_hist[r][1] for r in rows], torch.float32),
                     repetition=t([rows_hist[r][2] for r in rows], torch.float32),
                     output_ids=t(out_ids, torch.long), output_slot=t(out_slot, torch.long),
                     prompt_ids=t(pr_ids, torch.long), prompt_slot=t(pr_slot, torch.long))


def _penalised_float64(logits_row, hist):
    presence, frequency, repetition, prompt, output = hist
    x = logits_row.double().cpu().clone()
    counts = torch.zeros_like(x)
    for t in output:
        counts[t] += 1
    seen = counts > 0
    seen[list(prompt)] = True
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0).double()


def _random_history(rng, V):
    return (rng.choice([0.0, 0.5, -0.7, 2.0]), rng.choice([0.0, 0.3, 1.1, -0.4]), rng.choice([1.0, 1.3, 0.8, 2.0]),
            [rng.randrange(V) for _ in range(rng.randrange(1, 20))],
            [rng.randrange(V) for _ in range(rng.randrange(0, 30))])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["tempered_logprobs", "processed_logprobs", "raw_logprobs"])
def test_penalised_logprobs_against_float64(device, mode):
    rng = random.Random(7)
    torch.manual_seed(7)
    V = 300
    logits = torch.randn(6, V, device=device) * 2
    rows = [dict(t=t, k=0, p=1.0, m=0.0, seed=i, pos=i) for i, t in enumerate([0.0, 0.7, 1.0, 1.3, 1.0, 0.9])]
    hist = {i: _random_history(rng, V) for i in (0, 1, 3, 5)}
    hist[3] = (0.0, 1.5, 1.0, [1, 2], [4, 4, 4, 9])       # frequency only: counts matter
    batch = make_batch(rows, device, max_num_logprobs=5, mode=mode)
    batch.penalties = _penalties(hist, device)
    out = SAMPLER(logits, batch)
    for i, r in enumerate(rows):
        base = logits[i].double().cpu()
        pen = _penalised_float64(logits[i], hist[i]) if i in hist else base
        t = r["t"] if r["t"] > 0 else 1.0
        # raw_logprobs report the model's own distribution, before penalties and temperature;
        # tempered_logprobs the model's own over the temperature (penalties are the request's
        # controls: the trainer recomputes it); processed_logprobs the penalised one sampled from
        ref = {"raw_logprobs": torch.log_softmax(base, -1), "tempered_logprobs": torch.log_softmax(base / t, -1),
               "processed_logprobs": torch.log_softmax(pen / t, -1)}[mode]
        tok = out.token_ids[i].item()
        assert_close(out.logprobs[i:i + 1].double().cpu(), ref[tok:tok + 1], rtol=0, atol=2e-5)
        if r["t"] == 0.0:  # greedy picks the argmax of the penalised logits
            assert tok == int(torch.argmax(pen))


def _assert_row_bits_alone_and_batched(run, alone, i: int, rng) -> None:
    """Row i's sampled token, logprob and top-k bits in batches of 3, 8 and 16 of the 16 rows,
    first and last, equal `alone` (row i run by itself)."""
    for size in (3, 8, 16):
        others = rng.sample([j for j in range(16) if j != i], size - 1)
        for where in (0, size - 1):
            order = others[:where] + [i] + others[where:]
            out = run(order)
            assert out.token_ids[where].item() == alone.token_ids[0].item()
            assert bits(out.logprobs[where]).item() == bits(alone.logprobs[0]).item()
            assert torch.equal(bits(out.topk_logprobs[where]), bits(alone.topk_logprobs[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_batch_invariance_bits(device):
    """A penalised row's token and logprob bits do not depend on the rest of the batch."""
    rng = random.Random(11)
    torch.manual_seed(11)
    V = 1001
    pool = torch.randn(16, V, device=device) * 3
    params = [random_row_params(rng) for _ in range(16)]
    hists = {i: _random_history(rng, V) for i in range(16) if i % 3 != 1}

    def run(order):
        batch = make_batch([params[j] for j in order], device, max_num_logprobs=4)
        batch.penalties = _penalties({pos: hists[j] for pos, j in enumerate(order) if j in hists}, device)
        return SAMPLER(pool[order], batch)

    for i in (0, 2, 5, 9):
        alone = run([i])
        _assert_row_bits_alone_and_batched(run, alone, i, rng)


def test_penalties_in_the_engine_sync_equals_async(tiny_qwen3):
    """Through the engine: penalties change greedy output, and the async-scheduling loop
    (whose last output token is still on the device at launch) gives the same tokens."""
    from vllm import LLM, SamplingParams
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    results = {}
    for a in (False, True):
        llm = LLM(tiny_qwen3, device="cpu", numerics="invariant", async_scheduling=a)
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0,
                                                  presence_penalty=1.0, repetition_penalty=1.5, logprobs=0), use_tqdm=False)
        results[a] = (plain[0].outputs[0].token_ids, pen[0].outputs[0].token_ids,
                      [d[t].logprob for d, t in zip(pen[0].outputs[0].logprobs, pen[0].outputs[0].token_ids)])
    assert results[False][0] != results[False][1]
    assert results[False] == results[True]


# --------------------------------------------------------------------------- #
# logit_bias
# --------------------------------------------------------------------------- #
def _logit_bias(rows_bias, device):
    """rows_bias: {batch row: {token id: bias}}."""
    from vllm.sample.sampler import LogitBias
    rows = [r for r in sorted(rows_bias) for _ in rows_bias[r]]
    ids = [t for r in sorted(rows_bias) for t in rows_bias[r]]
    vals = [v for r in sorted(rows_bias) for v in rows_bias[r].values()]
    t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)
    return LogitBias(rows=t(rows, torch.long), token_ids=t(ids, torch.long), values=t(vals, torch.float32))


def _biased_by_hand(logits, rows_bias):
    """The biased logits as one float32 addition per biased element (the sampler's op)."""
    x = logits.float().clone()
    for r, bias in rows_bias.items():
        for t, v in bias.items():
            x[r, t] = x[r, t] + torch.tensor(v, dtype=torch.float32, device=logits.device)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logit_bias_by_logprobs_mode(device, mode):
    """logit_bias enters before the penalties (upstream's order): tokens and the processed
    modes are those of the logits biased by hand, pen(x + b), bit for bit. Like a grammar mask
    it is left out of the tempered and raw modes: they report the unbiased distribution bit for
    bit (what the trainer recomputes). Row 1's biased token is in its prompt with a repetition
    penalty, so biasing after the penalty would give other bits."""
    torch.manual_seed(17)
    V = 64
    logits = torch.randn(4, V, device=device)
    logits[1, 7] = 0.5
    rows = [dict(t=t, k=k, p=1.0, m=0.0, seed=s, pos=3) for t, k, s in ((0.0, 0, 1), (0.8, 0, 2), (1.0, 5, 3), (1.3, 0, 4))]
    bias = {0: {9: 100.0}, 1: {7: 5.0, 3: -2.5}, 2: {11: 3.0, 12: -100.0}}
    hist = {1: (0.0, 0.0, 2.0, [7, 8], [1]), 3: (0.5, 0.0, 1.0, [2], [2, 2])}

    def run(x, with_bias):
        batch = make_batch(rows, device, max_num_logprobs=V, mode=mode)
        batch.penalties = _penalties(hist, device)
        if with_bias:
            batch.logit_bias = _logit_bias(bias, device)
        return SAMPLER(x, batch)

    biased = run(logits, True)
    by_hand = run(_biased_by_hand(logits, bias), False)
    unbiased = run(logits, False)
    assert biased.token_ids[0].item() == 9    # greedy follows the bias
    assert torch.equal(biased.token_ids.cpu(), by_hand.token_ids.cpu())
    assert torch.equal(bits(biased.topk_logprobs[3]), bits(unbiased.topk_logprobs[3]))   # the unbiased row
    reported = by_hand if mode.startswith("processed") else unbiased
    assert torch.equal(bits(biased.topk_logprobs), bits(reported.topk_logprobs))
    assert torch.equal(biased.topk_ids.cpu(), reported.topk_ids.cpu())
    # the sampled token's value is read from the reported distribution
    want = reported.topk_logprobs.gather(1, (reported.topk_ids == biased.token_ids[:, None]).int().argmax(1, keepdim=True))
    assert torch.equal(bits(biased.logprobs), bits(want[:, 0]))
    assert not torch.equal(biased.token_ids.cpu(), unbiased.token_ids.cpu())   # the bias did change sampling


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["tempered_logprobs", "processed_logprobs"])
def test_logit_bias_batch_invariance_bits(device, mode):
    """A biased row's token and logprob bits do not depend on the rest of the batch (biased or
    not, penalised or not), and a row without a bias has the bits of a batch with no bias at all."""
    rng = random.Random(23)
    torch.manual_seed(23)
    V = 1001
    pool = torch.randn(16, V, device=device) * 3
    params = [random_row_params(rng) for _ in range(16)]
    hists = {i: _random_history(rng, V) for i in range(16) if i % 4 == 1}
    biases = {i: {rng.randrange(V): rng.choice([100.0, -100.0, 2.5, -0.75, 30.0]) for _ in range(rng.randrange(1, 6))}
              for i in range(16) if i % 3 != 2}

    def run(order, with_bias=True):
        batch = make_batch([params[j] for j in order], device, max_num_logprobs=4, mode=mode)
        batch.penalties = _penalties({pos: hists[j] for pos, j in enumerate(order) if j in hists}, device)
        rows_bias = {pos: biases[j] for pos, j in enumerate(order) if j in biases} if with_bias else {}
        batch.logit_bias = _logit_bias(rows_bias, device) if rows_bias else None
        return SAMPLER(pool[order], batch)

    for i in (0, 1, 2, 5, 9):
        alone = run([i])
        if i not in biases:
            plain = run([i], with_bias=False)
            assert torch.equal(bits(alone.topk_logprobs), bits(plain.topk_logprobs))
            assert alone.token_ids.item() == plain.token_ids.item()
        _assert_row_bits_alone_and_batched(run, alone, i, rng)
