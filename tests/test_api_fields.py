"""Every field of OpenAI's chat.completions and completions request schemas, honoured or refused.

The schemas come from the installed `openai` package, so a field a new release adds fails
`test_the_table_covers_every_field_of_both_schemas` until it is classified. Honoured sampling
fields are checked against mlx-lm on the same weights (its own `make_sampler` and
`make_logits_processors`); log probabilities against the log-softmax of the model's logits.
"""

from __future__ import annotations

import http.client
import json
import math

import mlx.core as mx
import mlx_lm
import pytest
from lazy_import import lazy_import
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from nodes import node_with_api
from repos import KIMI_K3

from expertmesh.coordinator.openai_api import OpenAIServer
from expertmesh.coordinator.openai_request import CALLER_FIELDS, HONOURED_CHAT, HONOURED_COMPLETIONS
from expertmesh.node.engine.chat import chat_token_ids

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "fields-test-secret"
PROMPT = "The cache keeps"
TOKENS = 6
# A prompt after which each penalty changes the tiny model's greedy answer (found by search: a
# random model rarely picks a token it has just seen, so most prompts show no penalty at all).
PENALISED = "by an it as the be on that an in it and"


@pytest.fixture(scope="module")
def api(module_home):
    with node_with_api(KIMI_K3, module_home, SECRET, "fields-node") as server:
        yield server


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)


def _post(api: OpenAIServer, body: dict, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# A value for each field that asks for something this server does not do: each must be a 400 naming it.
REFUSED = {
    CHAT: {
        "audio": {"voice": "alloy", "format": "wav"},
        "function_call": "auto",
        "functions": [{"name": "f"}],
        "modalities": ["text", "audio"],
        "moderation": {"type": "auto"},
        "parallel_tool_calls": False,  # at most one call: nothing enforces it
        "prediction": {"type": "content", "content": "x"},
        "prompt_cache_options": {"mode": "x"},
        "prompt_cache_retention": "24h",
        "reasoning_effort": "high",
        "service_tier": "flex",
        "store": True,
        "verbosity": "low",
        "web_search_options": {},
        "not_a_field": 1,  # a typo, or another server's extension
    },
    COMPLETIONS: {"best_of": 2, "echo": True, "suffix": "end", "not_a_field": 1},
}
# Fields whose effect this module checks against mlx-lm (the others: test_coordinator_api.py,
# test_openai_edges.py and test_api_server.py check model, messages, prompt, max_tokens,
# max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options and n;
# test_tool_calls.py and test_grammar.py check tools, tool_choice and response_format).
EFFECT_CHECKED_HERE = {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "top_k", "min_p",
                       "logprobs", "top_logprobs"}  # fmt: skip


def _schema_fields(params) -> set[str]:
    return set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_the_table_covers_every_field_of_both_schemas(path: str) -> None:
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import completion_create_params as chat_params

    schema = _schema_fields(chat_params if path == CHAT else completion_params)
    honoured = HONOURED_CHAT if path == CHAT else HONOURED_COMPLETIONS
    classified = honoured | CALLER_FIELDS | set(REFUSED[path])
    assert schema <= classified, f"fields neither honoured nor refused: {sorted(schema - classified)}"
    assert EFFECT_CHECKED_HERE <= HONOURED_CHAT


@pytest.mark.parametrize(("path", "field"), [(p, f) for p, fields in REFUSED.items() for f in fields])
def test_a_field_not_honoured_is_a_400_naming_it(api: OpenAIServer, path: str, field: str) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, field: REFUSED[path][field]}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    status, answer = _post(api, body, path)
    assert status == 400, answer
    assert answer["error"]["param"] == field and f"'{field}'" in answer["error"]["message"]


# The value that asks for nothing, spelled in another JSON type: Python's `==` took `0` for `false`
# and `1` for `true`, so these passed as neutral and the wrong type was never told.
WRONG_TYPE_NEUTRAL = [
    (CHAT, "store", 0),
    (CHAT, "parallel_tool_calls", 1),
    (COMPLETIONS, "echo", 0),
    (COMPLETIONS, "best_of", True),
    (COMPLETIONS, "best_of", 1.0),
]


@pytest.mark.parametrize(("path", "field", "value"), WRONG_TYPE_NEUTRAL)
def test_a_neutral_value_of_another_type_is_a_400_naming_it(api: OpenAIServer, path: str, field: str, value) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    status, answer = _post(api, body, path)
    assert status == 400, answer
    assert answer["error"]["param"] == field


@pytest.mark.parametrize(
    ("field", "value"),
    [("user", 5), ("metadata", "x"), ("metadata", {"k": 1}), ("safety_identifier", []), ("prompt_cache_key", 1)],
)
def test_a_caller_field_of_another_type_is_a_400_naming_it(api: OpenAIServer, field: str, value) -> None:
    """Caller fields change no answer, but a wrong type was accepted silently where OpenAI refuses it."""
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value}
    status, answer = _post(api, body, CHAT)
    assert status == 400, answer
    assert answer["error"]["param"] == field and f"'{field}'" in answer["error"]["message"]


def test_caller_fields_are_accepted_and_change_nothing(client: openai.OpenAI) -> None:
    def text(**extra) -> str:
        return (
            client.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=TOKENS, temperature=0, **extra)
            .choices[0]
            .text
        )

    plain = text()
    assert (
        text(user="u1", extra_body={"metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "c"}) == plain
    )


def _mlx_lm_text(oracle, ids: list[int], tokens: int, **processors) -> list[int]:
    model, tokenizer = oracle.load("kimi_k3")
    sampler = processors.pop("sampler", None) or make_sampler(0.0)
    out = mlx_lm.stream_generate(
        model,
        tokenizer,
        mx.array(ids),
        max_tokens=tokens,
        sampler=sampler,
        logits_processors=make_logits_processors(**processors) if processors else None,
    )
    return [r.token for r in out if r.finish_reason != "stop"]


def _completion_ids(client: openai.OpenAI, **extra) -> tuple[str, object]:
    """A greedy completion's text and its logprobs."""
    answer = client.completions.create(
        model=KIMI_K3, prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=0, **extra
    )
    return answer.choices[0].text, answer.choices[0].logprobs


@pytest.mark.parametrize(
    ("extra", "processors"),
    [
        ({"presence_penalty": 2.0}, {"presence_penalty": 2.0, "presence_context_size": 20}),
        ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0, "frequency_context_size": 20}),
        ({"extra_body": {"repetition_penalty": 3.0}}, {"repetition_penalty": 3.0, "repetition_context_size": 20}),
    ],
)
def test_penalties_are_mlx_lms_logits_processors(client: openai.OpenAI, oracle, extra: dict, processors: dict) -> None:
    _, tokenizer = oracle.load("kimi_k3")
    ids = tokenizer.encode(PENALISED)
    expected = _mlx_lm_text(oracle, ids, 8, **processors)
    assert expected != _mlx_lm_text(oracle, ids, 8)  # the penalty changes this answer
    answer = client.completions.create(model=KIMI_K3, prompt=PENALISED, max_tokens=8, temperature=0, **extra)
    text = answer.choices[0].text
    assert text == tokenizer.decode(expected)


def test_logit_bias_forces_a_token(client: openai.OpenAI, oracle) -> None:
    _, tokenizer = oracle.load("kimi_k3")
    token = tokenizer.encode(" cache")[-1]
    text, logprobs = _completion_ids(client, logit_bias={str(token): 100})
    assert text == tokenizer.decode([token] * TOKENS)
    assert all(p > -1e-3 for p in logprobs.token_logprobs)  # the biased token holds nearly all the mass


@pytest.mark.parametrize("extra_body", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_and_min_p_truncate_as_mlx_lms_sampler(client: openai.OpenAI, extra_body: dict) -> None:
    """At temperature 2 with one token left, the answer is the greedy one, whatever the seed."""
    greedy, _ = _completion_ids(client)
    for seed in (1, 2):
        answer = client.completions.create(
            model=KIMI_K3, prompt=PROMPT, max_tokens=TOKENS, temperature=2, seed=seed, extra_body=extra_body
        )
        assert answer.choices[0].text == greedy
    hot = {client.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=TOKENS, temperature=2, seed=s).choices[0].text for s in (1, 2, 3)}  # fmt: skip
    assert hot != {greedy}  # without truncation, temperature 2 wanders off


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_sampling_values_are_400s_naming_the_field(api: OpenAIServer, body: dict, field: str) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **body}
    status, answer = _post(api, body, CHAT)
    assert status == 400 and answer["error"]["param"] == field, answer


def test_a_logit_bias_token_beyond_the_vocabulary_is_a_400(api: OpenAIServer) -> None:
    body = {"model": KIMI_K3, "max_tokens": 2, "prompt": "hi", "logit_bias": {str(10**9): 5}}
    status, answer = _post(api, body, COMPLETIONS)
    assert status == 400 and "logit_bias" in answer["error"]["message"]


# -- logprobs ----------------------------------------------------------------------------------


def _reference_logprobs(oracle, ids: list[int], generated: list[int]) -> list[mx.array]:
    """The log-softmax of mlx-lm's logits at each generated token's step, fed as generation feeds
    them (the prompt, then one token a step, through a cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = oracle.load("kimi_k3")
    cache = make_prompt_cache(model)
    model(mx.array([ids[:-1]]), cache=cache)  # as mlx-lm prefills: all but the last token, then it alone
    rows = []
    for feed in [ids[-1:], *([t] for t in generated[:-1])]:
        logits = model(mx.array([feed]), cache=cache)[0, -1].astype(mx.float32)
        rows.append(logits - mx.logsumexp(logits))
    return rows


# The node computes in the model's dtype (bfloat16 here: 8 bits of mantissa, so a log probability
# near -5 is good to about 0.03, and the log-softmax's sum adds its own rounding), the reference in
# float32: they agree to two bfloat16 steps.
BF16 = {"rel_tol": 2**-6, "abs_tol": 1e-3}


def _check(rows: list[mx.array], generated: list[int], chosen: list[float], tops: list[list[float]]) -> None:
    """Each chosen token is the row's best (ties within the node's precision aside) with its log-softmax value; the alternatives are the
    row's largest values, in order (compared by value: several ids can decode to the same text)."""
    assert len(rows) == len(chosen) == len(tops)
    for row, token, logprob, top in zip(rows, generated, chosen, tops, strict=True):
        assert math.isclose(row[token].item(), row.max().item(), **BF16)  # greedy: the top one, up to a tie
        assert math.isclose(logprob, row[token].item(), **BF16)
        best = sorted(row.tolist(), reverse=True)[: len(top)]
        assert all(math.isclose(a, b, **BF16) for a, b in zip(top, best, strict=True))
        assert top == sorted(top, reverse=True) and math.isclose(top[0], logprob, abs_tol=1e-6)


def test_completion_logprobs_are_the_log_softmax_of_the_logits(client: openai.OpenAI, oracle) -> None:
    _, tokenizer = oracle.load("kimi_k3")
    ids = tokenizer.encode(PROMPT)
    answer = client.completions.create(model=KIMI_K3, prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=5)
    lp = answer.choices[0].logprobs
    generated = _mlx_lm_text(oracle, ids, TOKENS)
    assert "".join(lp.tokens) == answer.choices[0].text == tokenizer.decode(generated)
    # {text: logprob}: ids that decode alike share a key, so a step may list fewer than 5
    tops = [sorted(top.values(), reverse=True) for top in lp.top_logprobs]
    assert all(1 <= len(top) <= 5 for top in tops) and lp.text_offset[0] == 0
    rows = _reference_logprobs(oracle, ids, generated)
    _check(rows, generated, lp.token_logprobs, [[p] for p in lp.token_logprobs])
    for row, top in zip(rows, tops, strict=True):  # each listed one is among the row's 5 best
        best = sorted(row.tolist(), reverse=True)[:5]
        assert all(any(math.isclose(v, b, **BF16) for b in best) for v in top)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_streamed_or_not_are_the_log_softmax_of_the_logits(
    client: openai.OpenAI, oracle, stream: bool
) -> None:
    _, tokenizer = oracle.load("kimi_k3")
    messages = [{"role": "user", "content": "What is a cache?"}]
    ids = chat_token_ids(tokenizer, messages)
    kwargs = {
        "model": KIMI_K3,
        "messages": messages,
        "max_tokens": TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
    }
    if stream:
        entries, text = [], ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                entries += chunk.choices[0].logprobs.content or []
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        entries, text = choice.logprobs.content, choice.message.content
    generated = _mlx_lm_text(oracle, ids, TOKENS)
    assert text == tokenizer.decode(generated) == "".join(e.token for e in entries)
    # a token that is part of a character (this model makes some) has its own bytes, which join
    # with its neighbours' into the text, and not the replacement character's
    assert all(bytes(e.bytes).decode("utf-8", errors="replace") == e.token for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == text
    assert not any("\ufffd".encode() in bytes(e.bytes) for e in entries)
    tops = [[t.logprob for t in e.top_logprobs] for e in entries]
    assert all(len(t) == 20 for t in tops)
    _check(_reference_logprobs(oracle, ids, generated), generated, [e.logprob for e in entries], tops)


def test_streamed_completion_logprobs_equal_the_whole_ones(client: openai.OpenAI) -> None:
    """The legacy shape streamed: each chunk lists its own tokens, offsets run on across chunks."""
    kwargs = {"model": KIMI_K3, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 3}
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, logprobs, offsets = [], [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            logprobs += lp.token_logprobs
            offsets += lp.text_offset
    assert tokens == whole.tokens and logprobs == whole.token_logprobs and offsets == whole.text_offset
