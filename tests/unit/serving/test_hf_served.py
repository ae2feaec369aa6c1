"""Serving a Hugging Face model with the built-in engine (``model: {hf: DIR}``), its own
tokenizer and chat template, through the in-process OpenAI app; ``transformers`` is the oracle.

The tiny Qwen3 model's embedding table is padded past its tokenizer (320 rows, 300 tokens) and
the padded rows of ``lm_head`` are scaled up so that an unrestricted argmax would pick them:
greedy text equal to ``generate`` with those ids suppressed shows that sampling follows the
tokenizer (``vocab_limit``).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.models.hf.tokenizer import HFTokenizer, train_byte_level_bpe
from rayfleet.serving.openai_api.in_process import build_local
from rayfleet.serving.openai_api.app import encode_chat
from rayfleet.serving.openai_api.text_stream import DecodedTextStream
from rayfleet.serving.openai_api.tokenization import served_tokenizer
from rayfleet.serving.spec import ServeSpec
from rayfleet.storage.safetensors_io import read_side_files, write_files
from tests.unit.models.hf_fixtures import COMMON, randomize

transformers = pytest.importorskip("transformers")

KEY = "test-key-hf"
TOKENIZER_VOCAB, MODEL_VOCAB = 300, 320
TEXTS = ["def main():\n    print('héllo wörld')\n", "for i in range(10):\n    total += i * 2\n",
         "the router sends each token to two experts ✓", "class Model(nn.Module):\n    pass\n"] * 20
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write a loop in python"}]


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    monkeypatch.setenv("RAYFLEET_API_KEY", KEY)


def _save_model(out: Path, tok: HFTokenizer) -> None:
    config = transformers.Qwen3Config(**{**COMMON, "vocab_size": MODEL_VOCAB}, head_dim=16,
                                      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed=0)
    with torch.no_grad():
        model.lm_head.weight[TOKENIZER_VOCAB:] *= 40  # padded ids win an unrestricted argmax
    model.save_pretrained(out)
    write_files(str(out), tok.to_files())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tok = train_byte_level_bpe(TEXTS, vocab_size=TOKENIZER_VOCAB)
    out = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    _save_model(out, tok)
    return out


@pytest.fixture(scope="module")
def oracle(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


def _generate(oracle, ids: list[int], max_new_tokens: int, *, suppress: bool = True) -> list[int]:
    model, _ = oracle
    extra = {"suppress_tokens": list(range(TOKENIZER_VOCAB, MODEL_VOCAB))} if suppress else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **extra)
    return out[0, len(ids):].tolist()


def _spec(model_dir: Path) -> dict:
    return {"model": {"hf": str(model_dir)}, "engine": {"block_size": 8, "num_blocks": 64, "max_num_seqs": 4},
            "kv_transfer": {"transport": "local"}, "router": {"poll_interval_s": 0.02}, "request_timeout_s": 30}


@pytest.fixture(scope="module")
def served(model_dir):
    from starlette.testclient import TestClient

    with pytest.MonkeyPatch.context() as mp:  # module scope: the autouse key fixture is per test
        mp.setenv("RAYFLEET_API_KEY", KEY)
        local = build_local(_spec(model_dir))
        try:
            with TestClient(local.app(), headers={"Authorization": f"Bearer {KEY}"}) as client:
                yield local, client
        finally:
            local.shutdown()


def _post(client, path: str, body: dict) -> dict:
    resp = client.post(path, json={"model": "tiny-qwen3", "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream_text(client, path: str, body: dict) -> tuple[str, list[dict]]:
    chunks = []
    with client.stream("POST", path, json={"model": "tiny-qwen3", "temperature": 0, "stream": True, **body}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    parts = [c["choices"][0]["delta"].get("content", "") if "delta" in c["choices"][0] else c["choices"][0]["text"]
             for c in chunks if c["choices"]]
    return "".join(parts), chunks


def test_spec_accepts_an_hf_model_for_the_builtin_engine_and_refuses_overrides(model_dir):
    spec = ServeSpec.parse(_spec(model_dir))
    assert spec.engine.kind == "builtin" and spec.model.served_name == "tiny-qwen3"
    assert spec.engine_config().vocab_limit is None  # the engine takes it from the tokenizer
    with pytest.raises(SpecError) as err:
        ServeSpec.parse({**_spec(model_dir), "model": {"hf": str(model_dir), "overrides": {"num_layers": 1}}})
    assert err.value.field == "model.overrides"


def test_an_unsupported_architecture_is_refused_naming_the_field(model_dir, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SpecError, match="architectures"):
        build_local(_spec(bad))


def test_engine_uses_the_models_tokenizer_eos_and_vocab_limit(served, model_dir):
    local, _ = served
    engine = next(iter(local.engines.values())).engine
    tok = HFTokenizer.from_files(read_side_files(str(model_dir)))
    assert isinstance(engine.tokenizer, HFTokenizer) and engine.tokenizer.vocab_size == TOKENIZER_VOCAB
    assert engine.config.vocab_limit == TOKENIZER_VOCAB and engine.model.config.vocab_size == MODEL_VOCAB
    assert engine.eos_token_id == frozenset({tok.eos_id})  # generation_config.json's


def test_chat_prompt_is_the_models_own_template(served, oracle):
    local, client = served
    tok = served_tokenizer(asyncio.run(local.service.tokenizer()))
    expected = list(oracle[1].apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    assert encode_chat(CHAT, tok) == expected
    out = _post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "ignore_eos": True,
                                                  "return_token_ids": True})
    assert out["usage"]["prompt_tokens"] == len(expected)
    ref = _generate(oracle, expected, 5)
    assert out["choices"][0]["token_ids"] == ref
    assert out["choices"][0]["message"]["content"] == oracle[1].decode(ref, skip_special_tokens=True)


def test_greedy_completion_equals_transformers_generate(served, oracle):
    _, client = served
    prompt = "def main():\n    print("
    ids = [oracle[1].bos_token_id] + oracle[1].encode(prompt, add_special_tokens=False)
    unrestricted = _generate(oracle, ids, 6, suppress=False)
    assert any(t >= TOKENIZER_VOCAB for t in unrestricted)  # the padded rows would win without the limit
    ref = _generate(oracle, ids, 6)
    out = _post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "return_token_ids": True})
    choice = out["choices"][0]
    assert choice["token_ids"] == ref  # both stop at generation_config's EOS, if it comes
    assert choice["text"] == oracle[1].decode(ref, skip_special_tokens=True) and choice["text"]
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), len(ref))


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_concatenate_to_the_whole_text(served, chat):
    _, client = served
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"messages": CHAT} if chat else {"prompt": "the router sends"}
    body.update(max_tokens=24, ignore_eos=True)
    whole = _post(client, path, body)["choices"][0]
    whole_text = whole["message"]["content"] if chat else whole["text"]
    streamed, chunks = _stream_text(client, path, body)
    assert streamed == whole_text and len(whole_text) > 0
    assert len([c for c in chunks if c["choices"]]) > 2  # it really streamed in pieces


def test_stop_string_is_honoured(served):
    _, client = served
    body = {"prompt": "for i in range(", "max_tokens": 24, "ignore_eos": True}
    full = _post(client, "/v1/completions", body)["choices"][0]["text"]
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    expected = full[:full.find(stop)]
    out = _post(client, "/v1/completions", {**body, "stop": [stop]})["choices"][0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == (expected, "stop", stop)
    streamed, _ = _stream_text(client, "/v1/completions", {**body, "stop": [stop]})
    assert streamed == expected


def test_logprob_tokens_are_the_tokenizers(served, oracle):
    _, client = served
    out = _post(client, "/v1/completions", {"prompt": "class Model", "max_tokens": 4, "ignore_eos": True,
                                            "logprobs": 2, "return_token_ids": True})
    choice = out["choices"][0]
    assert choice["logprobs"]["tokens"] == [oracle[1].decode([t]) for t in choice["token_ids"]]
    assert all(len(top) >= 1 for top in choice["logprobs"]["top_logprobs"])
    chat = _post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "ignore_eos": True,
                                                   "logprobs": True, "return_token_ids": True})["choices"][0]
    tokens = [e["token"] for e in chat["logprobs"]["content"]]
    assert tokens == [oracle[1].decode([t]) for t in chat["token_ids"]]


def test_a_model_without_chat_template_gets_a_400_naming_the_fix(model_dir, tmp_path, monkeypatch):
    from starlette.testclient import TestClient

    monkeypatch.setenv("RAYFLEET_API_KEY", KEY)
    plain = tmp_path / "no-template"
    shutil.copytree(model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    local = build_local(_spec(plain))
    try:
        with TestClient(local.app(), headers={"Authorization": f"Bearer {KEY}"}) as client:
            resp = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
            assert resp.status_code == 400
            err = resp.json()["error"]
            assert err["param"] == "messages" and err["code"] == "chat_template_missing"
            assert "chat_template" in err["message"] and "/v1/completions" in err["message"]
            resp = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2})
            assert resp.status_code == 200, resp.text
    finally:
        local.shutdown()


def test_hf_tokenizer_pickles_for_the_serve_ingress(model_dir):
    tok = HFTokenizer.from_files(read_side_files(str(model_dir)))
    back = pickle.loads(pickle.dumps(tok))
    assert back.encode("héllo ✓", add_bos=True) == tok.encode("héllo ✓", add_bos=True)
    assert back.chat_template == tok.chat_template and back.eos_id == tok.eos_id


def test_decoded_stream_never_sends_a_split_character(model_dir):
    tok = HFTokenizer.from_files(read_side_files(str(model_dir)))
    text = "✓ héllo wörld ✓✓"
    ids = tok.encode(text)
    stream = DecodedTextStream(tok.decode)
    sent = [stream.feed([t]).text for t in ids] + [stream.finish().text]
    assert "".join(sent) == text and not any("\ufffd" in s for s in sent)
    # a broken variant (per-token decoding) would send U+FFFD for the multi-byte characters
    assert any("\ufffd" in tok.decode([t]) for t in ids)


def test_decoded_stream_equals_whole_decoding_in_any_chunking_and_cuts_at_stops(model_dir):
    import random

    tok = HFTokenizer.from_files(read_side_files(str(model_dir)))
    ids = tok.encode("✓ héllo wörld, def f(x): return x ✓✓ STOP 日本 " * 30)
    whole = tok.decode(ids)
    for stops in ((), ("STOP",), ("日本", "wörld,"), ("never here",)):
        expected = whole[:min(whole.find(s) for s in stops if s in whole)] if any(s in whole for s in stops) else whole
        rnd = random.Random(len(stops))
        stream, text, sent, i = DecodedTextStream(tok.decode, stops), "", [], 0
        while i < len(ids) and not stream.done:
            k = rnd.randint(1, 4)
            out = stream.feed(ids[i:i + k])
            text, sent, i = text + out.text, sent + out.token_ids, i + k
        out = stream.finish()
        text, sent = text + out.text, sent + out.token_ids
        assert text == expected, stops
        assert sent == ids[:len(sent)] and expected.startswith(tok.decode(sent)), stops  # tokens match the text


def test_disaggregated_pools_serve_the_same_chat_tokens(model_dir, oracle, monkeypatch):
    from starlette.testclient import TestClient

    monkeypatch.setenv("RAYFLEET_API_KEY", KEY)
    local = build_local({**_spec(model_dir), "mode": "disaggregated"})
    try:
        with TestClient(local.app(), headers={"Authorization": f"Bearer {KEY}"}) as client:
            out = _post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "ignore_eos": True,
                                                          "return_token_ids": True})
    finally:
        local.shutdown()
    prompt = list(oracle[1].apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"])
    assert out["choices"][0]["token_ids"] == _generate(oracle, prompt, 4)


def test_every_eos_of_generation_config_ends_a_request(model_dir, tmp_path):
    from rayfleet.serving.engine.loading import load_engine
    from rayfleet.serving.engine.sampling import SamplingParams
    from rayfleet.serving.engine.stop_checker import check_stop

    two = tmp_path / "two-eos"
    shutil.copytree(model_dir, two)
    gen = json.loads((two / "generation_config.json").read_text())
    (two / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [gen["eos_token_id"], 7]}))
    engine = load_engine(preset_name=None, seed=0, checkpoint=None, dtype="float32", overrides={},
                         config=ServeSpec.parse(_spec(two)).engine_config(), hf=str(two))
    assert engine.eos_token_id == frozenset({gen["eos_token_id"], 7})
    params = SamplingParams(max_tokens=10)
    stop = check_stop(output_token_ids=[5, 7], num_tokens=4, params=params, eos_token_id=engine.eos_token_id,
                      max_model_len=64, detokenize=None)
    assert stop is not None and stop.finish_reason.value == "stop"
    assert check_stop(output_token_ids=[5, 8], num_tokens=4, params=params, eos_token_id=engine.eos_token_id,
                      max_model_len=64, detokenize=None) is None
