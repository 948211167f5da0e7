"""/v1/embeddings over real HTTP, driven by the openai SDK (which asks for base64 and decodes it)."""
import base64

import numpy as np
import openai
import pytest
import torch

from gateway import api_types
from tests.gateway import http_util as http
from tests.gateway.conftest import API_KEY
from tests.gateway.test_live_api import conforms

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def reference(folder: str, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden state at the last token, normalised: the tiny llama's pooling."""
    from transformers import AutoModel
    hidden = AutoModel.from_pretrained(folder, dtype=torch.float32)(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden[-1], dim=0)


def test_openai_sdk_embeddings_match_transformers(client, tiny_servers, tiny_model_folder):
    texts = ["Hello world!", "Tea is a drink made from leaves."]
    r = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.model == "tiny"
    tok = tiny_servers.tokenizer
    ids = [tok.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    for d, i in zip(r.data, ids):
        assert torch.allclose(torch.tensor(d.embedding), reference(tiny_model_folder, i), atol=1e-4)
    single = client.embeddings.create(model="tiny", input=texts[0], encoding_format="float")
    assert np.allclose(single.data[0].embedding, r.data[0].embedding, atol=1e-5)
    by_ids = client.embeddings.create(model="tiny", input=[ids[1]], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, r.data[1].embedding, atol=1e-5)


def test_float_and_base64_carry_the_same_vector(tiny_servers):
    body = {"model": "tiny", "input": "Hello world!"}
    floats = http.post(tiny_servers.main + "/v1/embeddings", headers=AUTH, json_body=body)
    b64 = http.post(tiny_servers.main + "/v1/embeddings", headers=AUTH,
                    json_body={**body, "encoding_format": "base64"})
    for reply in (floats, b64):
        assert reply.status_code == 200
        conforms(reply.content, api_types.EmbeddingList)
    decoded = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.asarray(floats.json()["data"][0]["embedding"], dtype=np.float32))
    assert abs(np.linalg.norm(decoded) - 1) < 1e-5


def test_a_batch_of_64_inputs_and_bad_inputs(client):
    inputs = [f"Input number {i} about a topic." for i in range(64)]
    r = client.embeddings.create(model="tiny", input=inputs, encoding_format="float")
    assert len(r.data) == 64 and len({tuple(d.embedding) for d in r.data}) == 64
    dims = len(r.data[0].embedding)
    assert client.embeddings.create(model="tiny", input="x", dimensions=dims).data[0].embedding
    for kwargs, param in ((dict(input="x", dimensions=dims // 2), "dimensions"),
                          (dict(input=""), "input"), (dict(input=[[10 ** 7]]), "input"),
                          (dict(input="x", encoding_format="hex"), "encoding_format"),
                          (dict(input="x", extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny", **kwargs)
        assert e.value.body["param"] == param, kwargs


def test_truncate_prompt_tokens_embeds_the_inputs_tail(client, tiny_servers):
    ids = tiny_servers.tokenizer.encode("one two three four five six seven eight nine ten")
    cut = client.embeddings.create(model="tiny", input=[ids], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 4})
    tail = client.embeddings.create(model="tiny", input=[ids[-4:]], encoding_format="float")
    assert cut.usage.prompt_tokens == 4
    assert np.allclose(cut.data[0].embedding, tail.data[0].embedding, atol=1e-5)
