"""Suite `scale`'s arithmetic and its memory probe, without running a job: the trend of a cost
against model size (a log-log slope), the goals it judges, and the resident-set sampler
(`bench.memory.RssSampler`) that the suite's memory figures come from."""

from __future__ import annotations

import gc
import math
import mmap
import time
from dataclasses import fields, replace

from bench.memory import RssSampler, rss_bytes
from bench.scale import DERIVED, FLAT, SizeFigures, derived_table, follower_fit, goals, rank_comparisons, slope

MB = 1 << 20


def test_slope_is_zero_for_a_flat_cost_one_for_one_that_grows_with_the_table() -> None:
    xs = [1e8, 1e9, 4e9]
    assert slope(xs, [2.0, 2.0, 2.0]) == 0.0
    assert math.isclose(slope(xs, [x / 1e6 for x in xs]) or 0, 1.0)
    assert math.isclose(slope(xs, [1e9 / x for x in xs]) or 0, -1.0)  # falling
    assert slope(xs, [None, 3.0, 0.0]) is None  # fewer than two usable sizes
    assert math.isclose(slope(xs, [None, 3.0, 12.0]) or 0, math.log(4) / math.log(4))


def _figures(size: str, model_bytes: int, **kw: float) -> SizeFigures:
    base = {f.name: None for f in fields(SizeFigures)}
    base.update(size=size, ranks=2, model_rows=model_bytes // 256, model_bytes=model_bytes, rank_model_bytes=model_bytes // 2)
    base.update(compactions=1, follower_error=None, rows_per_interval=100_000.0)
    base.update(kw)
    return SizeFigures(**base)


def test_goals_flag_a_per_row_cost_that_grows_with_the_table_and_memory_over_its_bound() -> None:
    sizes = [_figures("a", 10**8), _figures("b", 10**9), _figures("c", 4 * 10**9)]
    flat = [
        replace(
            f,
            stall_ms=10.0,
            bytes_per_interval=2.4e6,
            time_to_commit_s=0.3,
            restore_s=f.model_bytes / 1e9 * 0.4,
            dcp_load_s=f.model_bytes / 1e9,
            compact_s=f.model_bytes / 1e9,
            export_s=f.model_bytes / 1e9 * 3,
            rss_none_bytes=10**9,
            rss_incremental_late_bytes=10**9 + f.rank_model_bytes // 10,
            rss_full_bytes=10**9 + f.rank_model_bytes,
            follower_store_bytes=f.model_bytes // 10,
            follower_rss_grown_bytes=f.model_bytes // 10 * 105 // 100,
        )
        for f in sizes
    ]
    met = {g.goal: g.met for g in goals(flat, derived_table(flat))}
    assert all(met.values()), met
    assert len([g for g in met if "slope" in g]) == len(FLAT)

    # the stall grows with the table (a scan of every row), memory over its bound, the follower 30% over
    grown = [
        replace(f, stall_ms=10.0 * f.model_bytes / 1e8, rss_incremental_late_bytes=10**9 + f.rank_model_bytes // 2) for f in flat
    ]
    grown[-1] = replace(grown[-1], follower_rss_grown_bytes=4 * 10**8 * 13 // 10, restore_s=grown[-1].dcp_load_s)
    judged = {g.goal.split(":")[0].split(",")[0]: g for g in goals(grown, derived_table(grown))}
    assert judged["stall_us_per_row"].met is False and math.isclose(judged["stall_us_per_row"].value or 0, 1.0)
    assert judged["bytes_per_row"].met is True
    assert judged["steady extra host memory / rank's model"].met is False
    assert judged["restore / dcp.load"].met is False
    assert judged["follower memory / documented store bytes"].met is False


def test_a_figure_missing_at_a_size_is_not_measured_rather_than_met() -> None:
    sizes = [_figures("a", 10**8), _figures("b", 10**9)]
    table = derived_table(sizes)
    assert set(table) == {d.name for d in DERIVED}
    assert all(g.met is None for g in goals(sizes, table))


def test_a_size_on_more_ranks_stays_out_of_the_trend_and_is_set_beside_its_model_per_rank() -> None:
    # `full4` is `full`'s model on 4 ranks: twice the changed rows in all (twice the batches),
    # the same stall per rank's row; its restore into 2 ranks took 1.5x its own
    full = _figures("full", 10**9, stall_ms=10.0, restore_s=1.0, dcp_load_s=2.0)
    full4 = replace(
        _figures("full4", 10**9, stall_ms=10.0, restore_s=0.8, dcp_load_s=2.0),
        ranks=4,
        rows_per_interval=200_000.0,
        restore_other_ranks=2,
        restore_other_s=1.2,
    )
    small = _figures("mid", 10**8, stall_ms=1.0, restore_s=0.1, dcp_load_s=0.2)
    figs = [small, full, full4]
    slopes = {g.goal.split(":")[0]: g.value for g in goals(figs, derived_table(figs))}
    assert math.isclose(slopes["stall_us_per_row"] or 0, 1.0)  # mid -> full only: full4's 10 ms is not a third point
    (c,) = rank_comparisons(figs, cores=2)
    assert (c.model, c.size, c.ranks, c.oversubscription) == ("full", "full4", 4, 2.0)
    assert rank_comparisons(figs, cores=16)[0].oversubscription == 1.0
    base, more, ratio = c.figures["stall_us_per_rank_row"]
    assert math.isclose(base or 0, 0.2) and math.isclose(more or 0, 0.2) and math.isclose(ratio or 0, 1.0)
    assert math.isclose(c.figures["restore_s_per_rank_gb"][2] or 0, 1.6)  # 0.8 s for a quarter vs 1.0 s for a half
    own, other, _ = c.figures["restore_other_ranks_over_own"]
    assert own is None and math.isclose(other or 0, 1.5)
    assert rank_comparisons([small, full4], cores=2) == []  # its 2-rank model did not run: nothing to set it beside


def test_the_sampler_sees_a_peak_between_samples_taken_and_leaves_it_out_of_a_later_window() -> None:
    gc.collect()
    sampler = RssSampler(every_s=0.01).start()
    area = mmap.mmap(-1, 256 * MB)
    area.write(b"\1" * (256 * MB))  # touched: resident
    held = rss_bytes()
    time.sleep(0.2)
    area.close()  # unmapped: given back to the OS at once
    closed = time.monotonic()
    time.sleep(0.6)
    peak = sampler.stop()
    assert peak >= held >= sampler.start_bytes + 200 * MB
    # the window from the unmap on leaves the spike out, however long the write took on a busy machine
    t0, t1 = sampler.samples[0][0], sampler.samples[-1][0]
    assert sampler.peak_after((closed - t0) / (t1 - t0)) < sampler.start_bytes + 100 * MB
    assert sampler.peak_after(0.0) == peak  # the whole time sampled holds it
    assert sampler.samples[0][1] == sampler.start_bytes and len(sampler.samples) > 5


def test_the_followers_growth_splits_into_bytes_per_store_byte_and_a_fixed_part() -> None:
    # 100 MB fixed plus 1.5 bytes per store byte (a transient that grows with the largest table)
    figs = [
        _figures(n, 10**9, follower_store_bytes=s, follower_rss_grown_bytes=int(1e8 + 1.5 * s))
        for n, s in (("a", 10**7), ("b", 10**8), ("c", 10**9))
    ]
    b, a = follower_fit(figs) or (0.0, 0.0)
    assert math.isclose(b, 1.5) and math.isclose(a, 1e8, rel_tol=1e-6)
    assert derived_table(figs)["follower_beyond_store"] == [int(1e8 + 0.5 * s) for s in (10**7, 10**8, 10**9)]
    judged = {g.goal: g.met for g in goals(figs, derived_table(figs))}
    assert judged["follower memory per documented store byte, beyond a fixed part (fit over sizes)"] is False
    exact = [replace(f, follower_rss_grown_bytes=int(1e8 + 1.02 * (f.follower_store_bytes or 0))) for f in figs]
    judged = {g.goal: g.met for g in goals(exact, derived_table(exact))}
    assert judged["follower memory per documented store byte, beyond a fixed part (fit over sizes)"] is True
    assert judged["follower memory / documented store bytes, worst size"] is False  # the fixed 100 MB at 10 MB
    assert follower_fit(figs[:1]) is None
