"""The bounded-error policy: the binomial certificate, its coverage, cold start, per-entry thresholds, shared counts."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_helpers import redis_server

from kvforge.reuse.bound import NEVER, binom_cdf, certify, clopper_pearson, min_wrong_needed, to_bin
from kvforge.reuse.guards import DEFAULT_GUARDS
from kvforge.reuse.policy import BoundedErrorPolicy, FixedThreshold, Prior, shipped_prior, wrong_bins
from kvforge.reuse.stats import SharedStats, StatsView
from kvforge.store import open_store


def test_binomial_cdf_and_interval_match_closed_forms():
    assert binom_cdf(0, 10, 0.1) == pytest.approx(0.9**10)
    assert binom_cdf(3, 10, 0.5) == pytest.approx(176 / 1024)
    assert binom_cdf(10, 10, 0.3) == 1.0 and binom_cdf(-1, 10, 0.3) == 0.0
    lo, hi = clopper_pearson(0, 186)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 186), rel=1e-6)  # k = 0: 1 - (alpha/2)^(1/n)
    lo, hi = clopper_pearson(186, 186)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / 186), rel=1e-6)


def test_cold_start_certifies_nothing():
    assert min_wrong_needed(0.01, 0.05) == 299
    assert certify([], 0.01, 0.05) == math.inf
    assert certify([NEVER] * 298, 0.01, 0.05) == math.inf  # 298 wrong candidates: not even t = 1 is certified
    assert certify([NEVER] * 299, 0.01, 0.05) == 0.0  # the guards refused all 299: any similarity is safe
    policy = BoundedErrorPolicy(0.01, prior=None)
    assert policy.threshold_for("k", DEFAULT_GUARDS, None) == math.inf
    assert policy.threshold_for("k", DEFAULT_GUARDS, StatsView()) == math.inf


def test_certificate_covers_the_false_hit_rate():
    """Simulated: wrong-candidate similarities ~ Beta(8, 2); the true false-hit rate at the certified threshold is
    <= delta in at least 1 - alpha of 200 repetitions (it is exact: here about 99%)."""
    delta, alpha, n = 0.05, 0.05, 600
    rng = random.Random(0)
    truth = sorted((rng.betavariate(8, 2) for _ in range(200_000)), reverse=True)

    def false_hit_rate(t: float) -> float:
        lo, hi = 0, len(truth)  # number of draws >= t (descending list)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if truth[mid] >= t else (lo, mid)
        return lo / len(truth)

    covered = 0
    for _ in range(200):
        t = certify([to_bin(rng.betavariate(8, 2)) for _ in range(n)], delta, alpha)
        covered += false_hit_rate(t) <= delta
    assert covered >= 200 * (1 - alpha) - 6  # binomial slack of the 200 repetitions


def test_stricter_with_smaller_max_error_and_guards_lower_it():
    rng = random.Random(1)
    bins = [to_bin(rng.uniform(0.5, 1.0)) for _ in range(2000)]
    assert certify(bins, 0.01, 0.05) > certify(bins, 0.05, 0.05) > 0.9
    refused = [NEVER if i % 10 else b for i, b in enumerate(bins)]  # guards refuse 90% of the wrong candidates
    assert certify(refused, 0.05, 0.05) < certify(bins, 0.05, 0.05)


def test_per_entry_threshold_rises_above_a_verified_error():
    prior = Prior("fake", {(1, "substitution", 600): 2000})  # 2000 wrong candidates, all refused by a guard
    policy = BoundedErrorPolicy(0.01, prior=prior, min_similarity=0.9)
    assert policy.threshold_for("a", DEFAULT_GUARDS, None) == 0.9  # certified 0, the floor rules
    stats = SharedStats(open_store("memory://"), "stats-", refresh_s=0)
    stats.observe("a", 0.955, True, (), to_bin(0.955))  # entry a answered wrong at 0.955
    stats.observe("b", 0.97, True, ("order",), to_bin(0.97))  # refused by a guard: teaches nothing about b
    view = stats.view()
    assert policy.threshold_for("a", DEFAULT_GUARDS, view) == pytest.approx(0.956)
    assert policy.threshold_for("b", DEFAULT_GUARDS, view) == 0.9
    assert policy.threshold_for("c", DEFAULT_GUARDS, view) == 0.9


def test_verified_wrong_candidates_raise_the_global_threshold():
    """A kind of near-miss the guards miss appears online: once enough are verified wrong, t* rises above them."""
    prior = Prior("fake", {(1, "substitution", 700): 1000})
    policy = BoundedErrorPolicy(0.05, prior=prior, min_similarity=0.5)
    assert policy.certified(DEFAULT_GUARDS, None) == 0.0
    stats = SharedStats(open_store("memory://"), "stats-", refresh_s=0)
    for i in range(120):
        sim = 0.93 + 0.0004 * i
        stats.observe(f"e{i}", sim, True, (), to_bin(sim))
    t = policy.certified(DEFAULT_GUARDS, stats.view())
    above = sum(1 for i in range(120) if 0.93 + 0.0004 * i >= t)
    assert t > 0.93 and binom_cdf(above, 1120, 0.05) <= 0.05


def test_fixed_threshold_ignores_statistics():
    assert FixedThreshold(0.7).threshold_for("x", (), None) == 0.7
    with pytest.raises(ValueError):
        FixedThreshold(1.5)
    with pytest.raises(ValueError, match="max_error"):
        BoundedErrorPolicy(0.0)


def test_shipped_prior_certifies_with_the_default_guards():
    prior = shipped_prior("all-minilm-l6-v2")
    assert prior is not None and sum(c for (w, _, _), c in prior.counts.items() if w) > 1000
    wrong = wrong_bins(prior.counts, DEFAULT_GUARDS)
    assert len(wrong) >= min_wrong_needed(0.01, 0.05)
    assert BoundedErrorPolicy(0.01, prior=prior).certified((), None) > 0.99  # without guards: near 1


# ---------------------------------------------------------------------------------------------- shared counts
def test_two_writers_merge_and_compaction_never_counts_twice():
    store = open_store("memory://")
    a, b = (SharedStats(store, "stats-", refresh_s=0, stale_s=0.0) for _ in range(2))
    for i in range(5):
        a.observe("k", 0.95, i % 2 == 0, (), to_bin(0.95))
    for _ in range(3):
        b.observe("k", 0.97, False, ("order",), to_bin(0.97))
    reader = SharedStats(store, "stats-", refresh_s=0)
    assert reader.view().num_observations == 8 and len(reader.view().entries["k"]) == 8
    assert a.compact() == 1  # b's blob folded into a's (b counts as silent with stale_s = 0)
    assert b.compact() == 1  # and a's into b's: both now hold copies of both
    b.observe("k", 0.97, False, (), to_bin(0.97))  # b goes on writing after being folded
    view = SharedStats(store, "stats-", refresh_s=0).view()
    assert view.num_observations == 9 and len(view.entries["k"]) == 9


WRITER = textwrap.dedent(
    """
    import sys
    from kvforge.reuse.stats import SharedStats
    from kvforge.store import open_store

    stats = SharedStats(open_store(sys.argv[1]), "kvforge-test-stats-", refresh_s=0)
    for i in range(int(sys.argv[3])):
        stats.observe(f"entry-{i % 7}", 0.9 + (i % 50) / 1000, i % 3 == 0, (), 900 + i % 50)
        if i % 25 == 0:
            stats.view()  # read the other writer's counts while it writes
    """
)


def _two_processes(url: str, tmp_path: Path, n: int = 100) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    procs = [subprocess.Popen([sys.executable, str(script), url, who, str(n)]) for who in "AB"]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    view = SharedStats(open_store(url), "kvforge-test-stats-", refresh_s=0).view()
    assert view.num_observations == 2 * n  # no update lost
    assert sum(c for (w, _, _), c in view.counts.items() if w) == 2 * sum(1 for i in range(n) if i % 3 == 0)
    assert sum(len(v) for v in view.entries.values()) == 2 * min(n, 7 * 32)


def test_two_processes_updating_a_file_store_lose_no_update(tmp_path: Path):
    _two_processes(f"file://{tmp_path}/kv", tmp_path)


@pytest.mark.redis
def test_two_processes_updating_redis_lose_no_update(tmp_path: Path):
    with redis_server(tmp_path) as url:
        _two_processes(url, tmp_path)
