"""LoRA adapters over HTTP with the official `openai` client: ``--lora-modules`` at start,
adapters listed in ``/v1/models`` with the base as ``parent``, ``model: NAME`` selects one
(the same tokens as the offline engine with that adapter), ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` at run time (a 404 after unloading), and bad adapters refused
with a 4xx that leaves the engine idle."""

from __future__ import annotations

import openai
import pytest

from pagedrs import LLM, SamplingParams
from pagedrs.lora import LoRARequest
from tests.helpers.servers import InProcessServer, engine_idle, wait_for
from tests.lora.test_lora_engine import checkpoint  # noqa: F401 - a fixture

PROMPT = [5, 17, 33, 2, 9]


@pytest.fixture(scope="module")
def server(checkpoint):  # noqa: F811 - the imported fixture
    base, adapters, _ = checkpoint
    server = InProcessServer(
        [base, "--device", "cpu", "--kv-cache-memory", "16MiB", "--enable-lora", "--max-lora-rank", "8"]
        + ["--max-loras", "2", "--lora-modules", f"a={adapters['a'][0]}", "--served-model-name", "base"]
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def _offline(checkpoint, name: str | None) -> list[int]:  # noqa: F811
    base, adapters, _ = checkpoint
    llm = LLM(base, device="cpu", enable_lora=True, max_lora_rank=8, kv_cache_memory="8MiB")
    lora = LoRARequest(name, 1, adapters[name][0]) if name else None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate([PROMPT], params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids


def _completion_tokens(client, model: str) -> list[int]:
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert reply.model == model
    return [int(token.removeprefix("w")) for token in reply.choices[0].logprobs.tokens]


def test_models_lists_adapters_with_their_parent(client):
    models = {model.id: model for model in client.models.list().data}
    assert set(models) == {"base", "a"}
    assert models["a"].model_extra["parent"] == "base" and models["base"].model_extra["parent"] is None


def test_model_selects_the_adapter(client, checkpoint, server):  # noqa: F811
    assert _completion_tokens(client, "a") == _offline(checkpoint, "a")
    assert _completion_tokens(client, "base") == _offline(checkpoint, None)
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=4, temperature=0
    )
    assert chat.model == "a"
    assert wait_for(lambda: engine_idle(server))


def test_adapters_load_and_unload_at_run_time(client, checkpoint, server):  # noqa: F811
    path = checkpoint[1]["b"][0]
    status, reply = server.http.request("POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": path})
    assert status == 200, reply
    assert "b" in {model.id for model in client.models.list().data}
    assert _completion_tokens(client, "b") == _offline(checkpoint, "b")
    status, reply = server.http.request("POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200, reply
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
    status, reply = server.http.request("POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404 and reply["error"]["param"] == "lora_name"
    assert wait_for(lambda: engine_idle(server))


def test_bad_adapters_are_4xx_and_leave_the_engine_idle(server, checkpoint, tmp_path):  # noqa: F811
    import peft
    import transformers

    big = transformers.AutoModelForCausalLM.from_pretrained(checkpoint[0])
    peft.get_peft_model(big, peft.LoraConfig(r=16, target_modules=["q_proj"])).save_pretrained(tmp_path / "r16")
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "not a directory"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "r16")}, "above max_lora_rank"),
        ({"lora_name": "a", "lora_path": checkpoint[1]["b"][0]}, "is taken"),
        ({"lora_name": "base", "lora_path": checkpoint[1]["b"][0]}, "is taken"),
        ({"lora_name": "x"}, "lora_path"),
    ]
    for body, message in cases:
        status, reply = server.http.request("POST", "/v1/load_lora_adapter", body)
        assert 400 <= status < 500 and message in reply["error"]["message"], (body, reply)
    status, reply = server.http.request("POST", "/v1/embeddings", {"model": "a", "input": "w5"})
    assert status == 400 and "LoRA adapter" in reply["error"]["message"]
    assert wait_for(lambda: engine_idle(server))


def _lora_info(server) -> dict[str, str]:
    import re

    status, text = server.http.request("GET", "/metrics")
    assert status == 200
    lines = [line for line in text.splitlines() if line.startswith("pagedrs:lora_requests_info{")]
    assert len(lines) == 1, lines  # one series at a time
    return dict(re.findall(r'(\w+)="([^"]*)"', lines[0]))


def test_the_lora_metric_names_running_adapters(client, server):
    stream = client.completions.create(
        model="a", prompt=PROMPT, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the request is running
    assert wait_for(lambda: _lora_info(server)["running_lora_adapters"] == "a")
    assert _lora_info(server)["max_lora"] == "2"
    stream.close()
    assert wait_for(lambda: _lora_info(server)["running_lora_adapters"] == "")
    assert wait_for(lambda: engine_idle(server))
