"""The built-in serving engine on ``ctx.device`` against the same engine on the CPU (issue 32).

Checks, in order (each engine is the product's: ``load_engine`` or ``LLMEngine`` over a preset):
1. ``greedy_matches_cpu``: greedy tokens of a few prompts on ``ctx.device`` equal the CPU
   engine's (same preset, same seed, so the same weights: ``init_weights`` draws from CPU
   generators on any device).
2. ``prefix_cache_reuse``: on the device engine, a request sharing a long prefix with an earlier
   one reports cached tokens, and its tokens equal the same request's after the cache is reset.
3. ``expert_balancing_same_tokens``: with the engine's expert balancing (``ExpertLoadBalancer``:
   redundant expert replicas, placement updates every few steps, as the replica's ``after_step``
   hook runs it) the greedy tokens equal the plain device engine's, and placements did change.
4. ``engine_device_published``: ``load_engine`` with no device lands on ``ctx.device`` (the
   replica's accelerator) and ``AsyncEngine.poll_state`` publishes it.
5. ``decode_tokens_per_s``: decode throughput at several batch sizes (a measurement).

Design decisions:
- float32 with TF32 off on both sides (restored afterwards), so greedy is exactly comparable up
  to summation order. A divergence is judged where it starts: the reference's top-2 logit gap
  there (a full-sequence forward of the reference model). Every divergence starting at a near
  tie (gap < ``NEAR_TIE``) passes *and says so* in the detail with the gaps; any other fails.
  Tokens after a divergence are counted as mismatches but not judged (they follow other inputs).
- ``ctx.quick`` (the CPU mode): the ``tiny`` preset, 8 tokens, batches 1 and 4; on a GPU the
  ``small`` preset, 32 tokens, batches 1, 8 and 32. No Ray, no Serve: the engine's Python API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayfleet.models import build_model, preset
from rayfleet.serving.engine.async_engine import AsyncEngine
from rayfleet.serving.engine.engine_config import EngineConfig
from rayfleet.serving.engine.llm_engine import LLMEngine
from rayfleet.serving.engine.loading import load_engine
from rayfleet.serving.engine.sampling import SamplingParams
from rayfleet.serving.experts.balancer import ExpertBalancingConfig, ExpertLoadBalancer

NEAR_TIE = 1e-4  # top-2 logit gap under which fp32 summation order may pick either token
SEED = 5


@dataclass(frozen=True)
class Sizes:
    preset_name: str
    overrides: dict
    prompt_lengths: tuple[int, ...]
    max_tokens: int
    prefix_len: int
    batches: tuple[int, ...]
    decode_tokens: int
    engine: EngineConfig


def _sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes("tiny", {"max_seq_len": 256, "init_std": 0.1}, (5, 17, 40), 8, 48, (1, 4), 8,
                     EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256))
    return Sizes("small", {"max_seq_len": 1024, "init_std": 0.1}, (7, 33, 96, 150, 250), 32, 256, (1, 8, 32), 64,
                 EngineConfig(block_size=16, num_blocks=1024, max_num_seqs=32, max_num_batched_tokens=2048))


@dataclass(frozen=True)
class Comparison:
    num_mismatched_tokens: int
    num_divergent: int
    num_near_tie: int
    gaps: tuple[float, ...]  # the reference's top-2 gap at each divergence

    @property
    def ok(self) -> bool:
        return self.num_divergent == self.num_near_tie

    def detail(self, what: str) -> str:
        if not self.num_divergent:
            return f"{what}: every token equal"
        gaps = ", ".join(f"{g:.2e}" for g in self.gaps)
        verdict = ("every divergence starts at a near tie" if self.ok
                   else f"{self.num_divergent - self.num_near_tie} divergences are not near ties")
        return (f"{what}: {self.num_mismatched_tokens} tokens differ in {self.num_divergent} sequences; "
                f"{verdict} (reference top-2 gaps {gaps}; near tie < {NEAR_TIE:g})")


@torch.inference_mode()
def _top2_gap(model: torch.nn.Module, tokens: Sequence[int]) -> float:
    device = next(model.parameters()).device
    logits = model(torch.tensor([list(tokens)], dtype=torch.long, device=device))[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _compare(reference: Sequence[Sequence[int]], got: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
             reference_model: torch.nn.Module) -> Comparison:
    mismatched = divergent = near = 0
    gaps = []
    for prompt, ref, out in zip(prompts, reference, got, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if first is None and len(ref) == len(out):
            continue
        first = min(len(ref), len(out)) if first is None else first
        mismatched += sum(a != b for a, b in zip(ref, out)) + abs(len(ref) - len(out))
        divergent += 1
        gap = _top2_gap(reference_model, [*prompt, *ref[:first]])
        gaps.append(gap)
        near += gap < NEAR_TIE
    return Comparison(mismatched, divergent, near, tuple(gaps))


def _prompts(lengths: Sequence[int], *, vocab: int = 256, seed: int = 11) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _tokens(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[tuple[int, ...]]:
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def _load(s: Sizes, device: str | None) -> LLMEngine:
    return load_engine(preset_name=s.preset_name, seed=SEED, checkpoint=None, dtype="float32",
                       overrides=s.overrides, config=s.engine, device=device)


def run(ctx) -> None:
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _run(ctx, _sizes(ctx.quick))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32


def _run(ctx, s: Sizes) -> None:
    greedy = SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True)
    prompts = _prompts(s.prompt_lengths)
    # (4) first: the device engine itself comes from load_engine's default device on a GPU.
    engine = _load(s, None if ctx.on_cuda else "cpu")
    _check_published_device(ctx, engine)

    # (1) device vs CPU.
    cpu = _load(s, "cpu")
    t0 = time.perf_counter()
    reference = _tokens(cpu, prompts, greedy)
    got = _tokens(engine, prompts, greedy)
    cmp = _compare(reference, got, prompts, cpu.model)
    ctx.record("greedy_matches_cpu", cmp.ok, cmp.detail(f"{len(prompts)} prompts x {s.max_tokens} tokens, "
                                                       f"{ctx.device} vs cpu, float32"),
               num_mismatched_tokens=cmp.num_mismatched_tokens, num_divergent=cmp.num_divergent,
               num_near_tie=cmp.num_near_tie, top2_gaps=list(cmp.gaps), seconds=time.perf_counter() - t0)
    del cpu

    _check_prefix_cache(ctx, engine, s, greedy)
    _check_expert_balancing(ctx, s, prompts, got, greedy, engine.model)
    _measure_decode(ctx, engine, s)


def _check_published_device(ctx, engine: LLMEngine) -> None:
    async def poll() -> str:
        runtime = AsyncEngine(engine, name="gpu-check/0")
        try:
            return (await runtime.poll_state()).device
        finally:
            runtime.shutdown()

    published = asyncio.run(poll())
    placed = {str(p.device) for p in engine.model.parameters()} | {str(engine.runner.kv_cache.k.device)}
    ok = published == str(ctx.device) and placed == {str(ctx.device)}
    ctx.record("engine_device_published", ok, f"ReplicaState.device={published!r}, model and KV cache on "
               f"{sorted(placed)} (expected {ctx.device})", device=published)


def _check_prefix_cache(ctx, engine: LLMEngine, s: Sizes, greedy: SamplingParams) -> None:
    prefix = _prompts((s.prefix_len,), seed=23)[0]
    first, second = [*prefix, 1, 2, 3], [*prefix, 4, 5, 6, 7]
    engine.generate([first], greedy)
    warm = engine.generate([second], greedy)[0]
    reset = engine.block_pool.reset_prefix_cache()
    cold = engine.generate([second], greedy)[0]
    cmp = _compare([cold.output_token_ids], [warm.output_token_ids], [second], engine.model)
    expected = s.prefix_len // s.engine.block_size * s.engine.block_size
    ok = cmp.ok and reset and warm.num_cached_tokens > 0 and cold.num_cached_tokens == 0
    ctx.record("prefix_cache_reuse", ok,
               cmp.detail(f"second request cached {warm.num_cached_tokens} of its {len(second)} prompt tokens "
                          f"(full blocks of the {s.prefix_len}-token prefix: {expected}); after a reset "
                          f"{cold.num_cached_tokens}; tokens with vs without the cache"),
               num_cached_tokens=warm.num_cached_tokens, num_cached_expected=expected,
               num_mismatched_tokens=cmp.num_mismatched_tokens)


def _check_expert_balancing(ctx, s: Sizes, prompts: list[list[int]], plain: list[tuple[int, ...]],
                            greedy: SamplingParams, plain_model: torch.nn.Module) -> None:
    model = build_model(preset(s.preset_name, **s.overrides), seed=SEED, dtype=torch.float32, device=ctx.device)
    # Four "devices" with one redundant slot each, a window every 2 steps and a re-placement per
    # window, so placements change while the requests decode.
    balancer = ExpertLoadBalancer(model, ExpertBalancingConfig(num_devices=4, num_redundant_experts=4,
                                                               window_steps=2, history_windows=4,
                                                               rebalance_every_windows=1))
    engine = LLMEngine(model, s.engine)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"eplb-{i}", prompt, greedy)
        tokens[f"eplb-{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        balancer.after_step()
    got = [tuple(tokens[f"eplb-{i}"]) for i in range(len(prompts))]
    cmp = _compare(plain, got, prompts, plain_model)
    replicated = int((balancer.placement.logical_replica_count > 1).sum())
    ok = cmp.ok and balancer.num_updates >= 1 and replicated > 0
    ctx.record("expert_balancing_same_tokens", ok,
               cmp.detail(f"{balancer.num_updates} placement updates, {replicated} replicated (layer, expert) "
                          f"pairs, {balancer.num_physical} slots for {balancer.num_experts} experts per layer; "
                          f"tokens vs the plain engine on {ctx.device}"),
               num_updates=balancer.num_updates, num_mismatched_tokens=cmp.num_mismatched_tokens)


def _measure_decode(ctx, engine: LLMEngine, s: Sizes) -> None:
    rates = {}
    for batch in s.batches:
        if ctx.time_left_s() < 20:
            ctx.skip(f"decode_tokens_per_s_b{batch}", f"{ctx.time_left_s():.0f} s of the run's budget left")
            continue
        engine.generate(_prompts([16] * batch, seed=batch), SamplingParams(max_tokens=4, temperature=0,
                                                                           ignore_eos=True))  # warm-up
        params = SamplingParams(max_tokens=s.decode_tokens + 1, temperature=0, ignore_eos=True)
        ids = [f"decode-{batch}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, _prompts([16] * batch, seed=100 + batch)):
            engine.add_request(rid, prompt, params)
        num_started = 0
        while num_started < batch:  # prefill (and the first token) untimed
            num_started += sum(bool(out.new_token_ids) and out.num_output_tokens == 1 for out in engine.step())
        ctx.sync()
        t0, num_tokens, num_steps = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            num_tokens += sum(len(out.new_token_ids) for out in engine.step())
            num_steps += 1
        ctx.sync()
        seconds = time.perf_counter() - t0
        rates[batch] = num_tokens / seconds
        ctx.record(f"decode_tokens_per_s_b{batch}", None,
                   f"batch {batch}: {rates[batch]:.0f} tokens/s, {1e3 * seconds / num_steps:.2f} ms per step "
                   f"({s.preset_name}, float32, {ctx.device})",
                   batch=batch, tokens_per_s=rates[batch], ms_per_step=1e3 * seconds / num_steps,
                   num_tokens=num_tokens)
