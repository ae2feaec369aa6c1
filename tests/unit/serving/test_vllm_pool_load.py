"""A vLLM pool's load from vLLM's metrics as Ray's Prometheus exports them
(``rayfleet.serving.vllm.pool_load``), without Ray: the text below has the shape Ray 2.60's
metrics agent serves (names sanitized to ``ray_vllm_*``, every series labelled ``ReplicaId``)."""

from __future__ import annotations

import math

from rayfleet.serving.deploy.serve_scaling_rules import ServeShellConfig, serve_observation
from rayfleet.serving.vllm.prometheus_scrape import parse_samples
from rayfleet.serving.vllm.pool_load import (LoadWindow, ReplicaSample, histogram_quantile, pool_load,
                                             replica_samples, window_buckets)

BOUNDS = (0.1, 0.5, 1.0, 2.5, 5.0)


def _labels(replica: str, **extra: str) -> str:
    labels = {"Component": "core_worker", "ReplicaId": replica, "SessionName": "s", "engine": "0",
              "model_name": "tiny-moe", **extra}
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def _scrape(replicas: dict[str, dict]) -> str:
    """Prometheus text for ``replicas``: id -> running, waiting, kv, ttft (a list of seconds)."""
    lines = ["# TYPE ray_vllm_num_requests_running gauge"]
    lines += [f"ray_vllm_num_requests_running{{{_labels(r)}}} {v['running']}" for r, v in replicas.items()]
    lines += ["# TYPE ray_vllm_num_requests_waiting gauge"]
    lines += [f"ray_vllm_num_requests_waiting{{{_labels(r)}}} {v['waiting']}" for r, v in replicas.items()]
    lines += ["# TYPE ray_vllm_num_requests_waiting_by_reason gauge"]  # must not count as waiting
    lines += [f"ray_vllm_num_requests_waiting_by_reason{{{_labels(r, reason='capacity')}}} 99" for r in replicas]
    lines += ["# TYPE ray_serve_replica_processing_queries gauge"]
    lines += [f'ray_serve_replica_processing_queries{{application="vllm-pd",deployment="Decode:tiny-moe",replica="{r}"}} '
              f'{v["ongoing"]}' for r, v in replicas.items() if "ongoing" in v]
    lines += ["# TYPE ray_vllm_kv_cache_usage_perc gauge"]
    lines += [f"ray_vllm_kv_cache_usage_perc{{{_labels(r)}}} {v['kv']}" for r, v in replicas.items()]
    lines += ["# TYPE ray_vllm_time_to_first_token_seconds histogram"]
    for r, v in replicas.items():
        ttft = v["ttft"]
        for bound in (*BOUNDS, math.inf):
            le = "+Inf" if math.isinf(bound) else str(bound)
            lines.append(f"ray_vllm_time_to_first_token_seconds_bucket{{{_labels(r, le=le)}}} "
                         f"{sum(1 for t in ttft if t <= bound)}")
        lines.append(f"ray_vllm_time_to_first_token_seconds_count{{{_labels(r)}}} {len(ttft)}")
        lines.append(f"ray_vllm_time_to_first_token_seconds_sum{{{_labels(r)}}} {sum(ttft)}")
    return "\n".join(lines) + "\n"


def _replica(running=0, waiting=0, kv=0.0, ttft=(), ongoing=None):
    out = {"running": running, "waiting": waiting, "kv": kv, "ttft": list(ttft)}
    return out if ongoing is None else {**out, "ongoing": ongoing}


def test_histogram_quantile_is_prometheus_linear_interpolation():
    buckets = [(0.1, 0), (0.5, 10), (1.0, 20), (math.inf, 20)]
    assert math.isclose(histogram_quantile(0.95, buckets), 0.95)  # 0.5 + 0.5 * (19 - 10) / 10
    assert math.isclose(histogram_quantile(0.5, buckets), 0.5)
    assert histogram_quantile(0.95, [(0.1, 0), (1.0, 0), (math.inf, 0)]) == 0.0  # nothing observed
    assert histogram_quantile(0.95, []) == 0.0
    assert histogram_quantile(0.95, [(0.1, 1), (1.0, 1), (math.inf, 5)]) == 1.0  # in +Inf: the highest bound


def test_only_the_pools_live_replicas_count():
    text = _scrape({"d1": _replica(running=3, waiting=2, kv=0.4, ttft=[0.05, 0.3]),
                    "d2": _replica(running=1, kv=0.7),
                    "p1": _replica(running=5, waiting=5, kv=0.9),  # the prefill pool's replica
                    "gone": _replica(running=7, kv=1.0)})  # a stopped replica's lingering gauges
    samples = replica_samples(parse_samples(text), {"d1", "d2"})
    assert set(samples) == {"d1", "d2"}
    assert samples["d1"] == ReplicaSample(running=3, waiting=2, kv_usage=0.4,
                                          ttft_buckets=((0.1, 1), (0.5, 2), (1.0, 2), (2.5, 2), (5.0, 2), (math.inf, 2)))
    load = pool_load(samples, samples)
    assert (load.in_flight, load.waiting, load.num_ttft, load.ttft_p95_s) == (6, 2, 0, 0.0)
    assert load.kv_usage_by_replica == {"d1": 0.4, "d2": 0.7}


def test_in_flight_counts_serves_ongoing_requests_of_a_pd_decode_replica():
    """A PD request belongs to the decode replica while its prefill runs on the other pool: Serve's
    ongoing count sees it, the decode engine's gauges do not (the broken variant: 1 in flight for 4
    streaming clients, so the wanted replicas flapped and the lent one was drained at once)."""
    text = _scrape({"d1": _replica(running=1, ongoing=4), "d2": _replica(running=3, waiting=2, ongoing=1)})
    samples = replica_samples(parse_samples(text, contains=""), {"d1", "d2"})
    assert (samples["d1"].ongoing, samples["d2"].ongoing) == (4, 1)
    assert pool_load(samples, samples).in_flight == 4 + 5  # the larger figure per replica (exports lag apart)
    assert samples["d1"].running + samples["d1"].waiting == 1  # the broken variant: the engine alone


def test_ttft_p95_is_over_the_window_not_the_engines_lifetime():
    """200 fast TTFTs before the window, 8 slow ones in it: the window's p95 is slow. The broken
    variant (the cumulative histogram) reports the fast bucket and would not see the burst."""
    before = replica_samples(parse_samples(_scrape({"d1": _replica(ttft=[0.05] * 200)})), {"d1"})
    now = replica_samples(parse_samples(_scrape({"d1": _replica(running=4, ttft=[0.05] * 200 + [3.0] * 8)})), {"d1"})
    load = pool_load(now, before)
    assert load.num_ttft == 8 and 2.5 < load.ttft_p95_s <= 5.0
    assert histogram_quantile(0.95, now["d1"].ttft_buckets) <= 0.1  # the broken variant
    assert load.in_flight == 4


def test_new_and_restarted_replicas_count_from_zero():
    before = {"d1": ReplicaSample(ttft_buckets=((1.0, 50), (math.inf, 50)))}
    now = {"d1": ReplicaSample(ttft_buckets=((1.0, 3), (math.inf, 4))),  # restarted: counts went down
           "d2": ReplicaSample(ttft_buckets=((1.0, 2), (math.inf, 2)))}  # lent since the window began
    assert window_buckets(now, before) == ((1.0, 5), (math.inf, 6))


def test_load_window_forgets_what_is_older_than_the_window():
    window = LoadWindow(window_s=10.0)

    def scrape(ttft, running=0):
        return replica_samples(parse_samples(_scrape({"d1": _replica(running=running, ttft=ttft)})), {"d1"})

    # the first scrape is its own baseline: TTFTs from before the shell started are not in the window
    assert window.add(0.0, scrape([4.0] * 10)).num_ttft == 0
    burst = window.add(5.0, scrape([4.0] * 10 + [3.0] * 8, running=6))
    assert burst.num_ttft == 8 and burst.ttft_p95_s > 2.5 and burst.in_flight == 6
    still = window.add(12.0, scrape([4.0] * 10 + [3.0] * 8))  # baseline: the scrape at t=0
    assert still.num_ttft == 8
    assert still.in_flight == 6  # the busy sample at t=5 is still in the window
    quiet = window.add(16.0, scrape([4.0] * 10 + [3.0] * 8))  # baseline: t=5; nothing new since
    assert (quiet.num_ttft, quiet.ttft_p95_s, quiet.in_flight) == (0, 0.0, 0)


def test_a_scrape_that_missed_a_live_replica_neither_idles_it_nor_counts_its_whole_history():
    """A node's metrics endpoint timed out (busy host): the replica is alive but absent from the
    scrape. Its gauges carry over, and once it is back its TTFTs count from its own last sample,
    not from zero: the slow TTFTs of an earlier burst are not in the window (seen live: an idle
    pool read as TTFT p95 over its SLO and was lent a second accelerator)."""
    window = LoadWindow(window_s=10.0)
    burst = [9.0] * 40  # TTFTs of a burst, before the window

    def scrape(ttft, running=0):
        return replica_samples(parse_samples(_scrape({"d1": _replica(running=running, ttft=ttft)})), {"d1"})

    window.add(0.0, scrape(burst, running=3), live={"d1"})
    missed = window.add(4.0, {}, live={"d1"})  # the scrape failed for d1's node
    assert missed.in_flight == 3  # carried (and the window's highest)
    for t in (8.0, 12.0, 16.0):
        window.add(t, {}, live={"d1"})
    back = window.add(20.0, scrape(burst + [0.05] * 4), live={"d1"})
    assert back.num_ttft == 4 and back.ttft_p95_s <= 0.1, back
    assert back.in_flight == 3  # its carried samples (t=12, 16) are still in the window
    # The broken variant: a baseline scrape without d1 counts its whole history.
    assert pool_load(scrape(burst + [0.05] * 4), {}).ttft_p95_s >= 5.0
    # A replica gone from ``live`` is forgotten; one never seen counts from zero.
    window.add(24.0, {}, live=set())
    fresh = window.add(40.0, scrape([0.05] * 4), live={"d1"})
    assert fresh.num_ttft == 4
    # Past ``carry_s`` a missing replica's gauges are no longer carried.
    late = LoadWindow(window_s=10.0, carry_s=5.0)
    late.add(0.0, scrape([], running=3), live={"d1"})
    assert [late.add(t, {}, live={"d1"}).in_flight for t in (4.0, 16.0)] == [3, 0]


def test_one_low_gauge_sample_in_a_burst_does_not_read_as_low_load():
    """The gauges are point samples exported every few seconds: in flight is the window's highest."""
    window = LoadWindow(window_s=10.0)

    def scrape(running):
        return replica_samples(parse_samples(_scrape({"d1": _replica(ongoing=running)}), contains=""), {"d1"})

    assert [window.add(t, scrape(r)).in_flight for t, r in ((0, 3), (4, 0), (8, 3), (12, 0), (16, 0), (19, 0))] == \
        [3, 3, 3, 3, 3, 0]  # low only once no busy sample is left in the last 10 s


def test_serve_observation_takes_a_vllm_pools_load():
    load = pool_load({"d1": ReplicaSample(running=5, waiting=2, kv_usage=0.3,
                                          ttft_buckets=((0.5, 0), (2.5, 10), (math.inf, 10)))}, {})
    obs = serve_observation(deployment="vllm-pd", accelerator_type="H100", accelerators_per_replica=1,
                            load=load.as_load(), kv_usage_by_replica=dict(load.kv_usage_by_replica),
                            base_nodes=["n1"], lent=[], config=ServeShellConfig(target_ongoing_requests=2,
                                                                                max_replicas=2))
    assert (obs.desired_replicas, obs.queue_depth, obs.kv_usage) == (2, 2.0, 0.3)
    assert math.isclose(obs.ttft_p95_s, 0.5 + 2.0 * 0.95)


_ENDPOINT = """# HELP ray_vllm:num_requests_running Number of requests in model execution batches.
# TYPE ray_vllm:num_requests_running gauge
ray_vllm:num_requests_running{ReplicaId="r1",engine="0"} 2.0
# HELP ray_vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE ray_vllm:time_to_first_token_seconds histogram
ray_vllm:time_to_first_token_seconds_bucket{ReplicaId="r1",le="0.5"} 3.0
ray_vllm:time_to_first_token_seconds_bucket{ReplicaId="r1",le="+Inf"} 4.0
ray_vllm:time_to_first_token_seconds_sum{ReplicaId="r1"} 1.5
ray_vllm:time_to_first_token_seconds_count{ReplicaId="r1"} 4.0
# HELP ray_vllm:generation_tokens_total Number of generation tokens processed.
# TYPE ray_vllm:generation_tokens_total counter
ray_vllm:generation_tokens_total{ReplicaId="r1",note="num_requests_running"} 99.0
# HELP ray_serve_replica_processing_queries The current number of queries being processed.
# TYPE ray_serve_replica_processing_queries gauge
ray_serve_replica_processing_queries{replica="r1"} 1.0
# HELP ray_node_cpu_utilization Total CPU usage.
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{ip="127.0.0.1"} 3.0
"""


def test_the_pool_scrape_parses_only_the_series_it_reads_and_reads_the_same_load():
    from rayfleet.serving.vllm.pool_load import POOL_LOAD_METRICS

    every = parse_samples(_ENDPOINT, contains="")
    only = parse_samples(_ENDPOINT, contains="", names=POOL_LOAD_METRICS)
    assert {s.name for s in only} == {"ray_vllm:num_requests_running", "ray_vllm:time_to_first_token_seconds_bucket",
                                      "ray_serve_replica_processing_queries"}  # a label naming one does not count
    assert replica_samples(only, {"r1"}) == replica_samples(every, {"r1"})
    assert len(every) == 8 and parse_samples(_ENDPOINT) == [s for s in every if "vllm" in s.name]


def test_the_pool_load_source_scrapes_once_per_metrics_export(monkeypatch):
    import rayfleet.serving.vllm.pool_load as pool_load_module
    import rayfleet.serving.vllm.prometheus_scrape as scrape_module

    scrapes = []
    monkeypatch.setattr(pool_load_module, "pool_replica_ids", lambda app, dep: {"r1"})
    monkeypatch.setattr(scrape_module, "scrape_vllm_metrics",
                        lambda **kw: scrapes.append(kw) or parse_samples(_ENDPOINT, contains="", names=kw["names"]))
    clock = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    source = pool_load_module.VLLMPoolLoadSource("app", "Decode", window_s=10.0, min_interval_s=2.0)
    monkeypatch.setattr("rayfleet.platform.ray_compat.metrics_export_interval_s", lambda: 2.0)
    first = source.sample()
    assert first[0]["age_s"] == 2.0  # what the agent exported up to one interval before the scrape
    clock[0] += 1.0
    again = source.sample()
    assert len(scrapes) == 1  # between two exports: the same figures, a second older
    assert {**again[0], "age_s": None} == {**first[0], "age_s": None} and again[0]["age_s"] == 3.0
    clock[0] += 1.5
    assert source.sample()[0]["age_s"] == 2.0
    assert len(scrapes) == 2 and first[0]["in_flight"] == 2
