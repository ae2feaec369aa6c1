"""One vLLM offline engine (``vllm.LLM``) for every offline check; results as JSON after ``OFFLINE_RESULT``.

    python tests/vllm/offline_engine.py MODEL_DIR SPEC_JSON

``SPEC_JSON``: ``{"greedy": [prompt, ...], "max_tokens": N, "events": [prompt A, filler, ...],
"num_blocks": N}``. One engine start (15-25 s of an idle core, more on a busy one) serves both
parts, in this order:

1. greedy: the prompts generated twice, greedy (the second pass from the prefix cache): prompt
   ids, tokens of both passes, cached tokens of the second;
2. KV events: the engine has the ``kv_events_config`` ``RayfleetLLMServer`` gives it (ZMQ on a
   private ipc socket) and a KV cache of ``num_blocks`` blocks of 32 tokens
   (``num_gpu_blocks_override``); the subscriber (``KVEventSubscriber``, in this process as in the
   replica) is drained after part 1, then the event prompts run one at a time (the first, then
   fillers that push the cache past its capacity) and each one's stored/removed hashes are kept.

Its own process: vLLM spawns its engine core and worker processes (hence the ``__main__`` guard),
and a pytest process must not carry them.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

BLOCK, MODEL_ID, MAX_MODEL_LEN = 32, "tiny-moe", 256


def _wait(sub, at_least: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sub.num_batches < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams

    from rayfleet.serving.vllm.kv_event_subscriber import KV_EVENTS_TOPIC, KVEventSubscriber, private_ipc_endpoint

    endpoint = private_ipc_endpoint()
    sub = KVEventSubscriber(endpoint, model_id=MODEL_ID, block_size=BLOCK)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, block_size=BLOCK,
              seed=0, enable_prefix_caching=True, num_gpu_blocks_override=spec["num_blocks"],
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                "topic": KV_EVENTS_TOPIC})

    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    first = llm.generate(spec["greedy"], params, use_tqdm=False)
    again = llm.generate(spec["greedy"], params, use_tqdm=False)  # prefix cache hits must not change a token
    greedy = {"prompt_ids": [list(o.prompt_token_ids) for o in first],
              "tokens": [list(o.outputs[0].token_ids) for o in first],
              "tokens_again": [list(o.outputs[0].token_ids) for o in again],
              "cached_tokens_again": [int(o.num_cached_tokens or 0) for o in again]}

    time.sleep(0.3)  # part 1's last batches, then they are dropped
    sub.drain()
    steps = []
    for prompt in spec["events"]:
        before = sub.num_batches
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
        _wait(sub, before + 1)
        time.sleep(0.3)  # the rest of this request's batches
        events = sub.drain()
        steps.append({"prompt_ids": list(out.prompt_token_ids),
                      "stored": [h.hex() for e in events for h in e.stored],
                      "removed": [h.hex() for e in events for h in e.removed],
                      "cleared": any(e.cleared for e in events)})
    kv_events = {"steps": steps, "num_gaps": sub.num_gaps, "num_errors": sub.num_errors,
                 "num_unchained": sub.mapper.num_unchained, "cached": [h.hex() for h in sub.mapper.cached()],
                 "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    sub.close()
    print("OFFLINE_RESULT " + json.dumps({"greedy": greedy, "kv_events": kv_events}), flush=True)


if __name__ == "__main__":
    main()
