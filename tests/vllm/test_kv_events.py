"""A real vLLM engine's KV events, through rayfleet's subscriber: a prompt's blocks arrive as
``BlockStored`` in the hashes the router computes from the prompt's token ids, and once the cache
is filled past its capacity the evicted ones arrive as ``BlockRemoved`` (no fleet: the offline
engine in its own process, ``offline_kv_events.py``, as ``test_offline`` runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rayfleet.serving.routing.prompt_hashes import PromptHashCache

from .conftest import long_prompt

NUM_BLOCKS = 12  # of 32 tokens: a prompt of ~100 tokens holds 3; five such prompts overflow it


def test_vllm_engine_events_reach_the_replica_index_stored_then_evicted(tiny_model_dir):
    prompts = [long_prompt(seed, 100) for seed in range(1, 7)]  # the first one, then five fillers
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_kv_events.py")), str(tiny_model_dir),
                           json.dumps(prompts), str(NUM_BLOCKS)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("KV_EVENTS_RESULT ")), None)
    assert line, proc.stdout[-3000:]
    result = json.loads(line.split(" ", 1)[1])
    assert result["num_blocks"] == NUM_BLOCKS
    assert result["num_gaps"] == result["num_errors"] == result["num_unchained"] == 0

    first = result["steps"][0]
    router = [h.hex() for h in PromptHashCache(block_size=32, model_id="tiny-moe").hashes(first["prompt_ids"])]
    assert len(router) >= 3
    # Its blocks were stored, in exactly the hashes the router computes for the same tokens
    # (vLLM's own hashes differ: salted per process). A broken mapping (no parent chain) would
    # match only the first block: the chain is what makes blocks 2.. equal.
    assert first["stored"][:len(router)] == router and not first["removed"]

    # The fillers overflow the 12-block cache: vLLM evicts the first prompt's blocks (LRU) and
    # says so; the replica then stops claiming them.
    removed = {h for step in result["steps"][1:] for h in step["removed"]}
    assert set(router) & removed, "no block of the first prompt was reported evicted"
    assert not set(router) & removed & set(result["cached"])  # what was evicted is not claimed
    assert len(result["cached"]) <= NUM_BLOCKS  # never more than the engine can hold
