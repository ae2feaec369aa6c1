"""vLLM's offline engine publishing KV events to rayfleet's subscriber; results as JSON after ``KV_EVENTS_RESULT``.

    python tests/vllm/offline_kv_events.py MODEL_DIR '["prompt A", "filler", ...]' NUM_BLOCKS

The engine gets the ``kv_events_config`` ``RayfleetLLMServer`` gives it (ZMQ on a private ipc
socket) and a KV cache of ``NUM_BLOCKS`` blocks of 32 tokens (``num_gpu_blocks_override``). The
first prompt runs, then the fillers, one at a time, which push the cache past its capacity. The
subscriber (``KVEventSubscriber``, in this process as in the replica) reports what it mapped.
Its own process: vLLM spawns its engine core (hence the ``__main__`` guard).
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

BLOCK, MODEL_ID = 32, "tiny-moe"


def _wait(sub, at_least: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sub.num_batches < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    model_dir, prompts, num_blocks = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    from vllm import LLM, SamplingParams

    from rayfleet.serving.vllm.kv_event_subscriber import KV_EVENTS_TOPIC, KVEventSubscriber, private_ipc_endpoint

    endpoint = private_ipc_endpoint()
    sub = KVEventSubscriber(endpoint, model_id=MODEL_ID, block_size=BLOCK)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, enforce_eager=True, block_size=BLOCK, seed=0,
              enable_prefix_caching=True, num_gpu_blocks_override=num_blocks,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                "topic": KV_EVENTS_TOPIC})
    params = SamplingParams(max_tokens=1, temperature=0.0)
    steps = []
    for prompt in prompts:
        before = sub.num_batches
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        _wait(sub, before + 1)
        time.sleep(0.3)  # the rest of this request's batches
        events = sub.drain()
        steps.append({"prompt_ids": list(out.prompt_token_ids),
                      "stored": [h.hex() for e in events for h in e.stored],
                      "removed": [h.hex() for e in events for h in e.removed],
                      "cleared": any(e.cleared for e in events)})
    result = {"steps": steps, "num_gaps": sub.num_gaps, "num_errors": sub.num_errors,
              "num_unchained": sub.mapper.num_unchained, "cached": [h.hex() for h in sub.mapper.cached()],
              "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
    sub.close()
    print("KV_EVENTS_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
