"""Greedy token ids from vLLM's offline engine (``vllm.LLM``), printed as JSON after ``OFFLINE_RESULT``.

    python tests/vllm/offline_greedy.py MODEL_DIR '["prompt", ...]' MAX_TOKENS DTYPE

Its own process: vLLM spawns its engine core and worker processes (hence the ``__main__``
guard), and the pytest process that drives the fleet must not carry them.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> None:
    model_dir, prompts, max_tokens, dtype = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=512, enforce_eager=True, block_size=32, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)  # prefix cache hits must not change a token
    result = {"prompt_ids": [list(o.prompt_token_ids) for o in first],
              "tokens": [list(o.outputs[0].token_ids) for o in first],
              "tokens_again": [list(o.outputs[0].token_ids) for o in again],
              "cached_tokens_again": [int(o.num_cached_tokens or 0) for o in again]}
    print("OFFLINE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
