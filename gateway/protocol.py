"""OpenAI request bodies as msgspec Structs, and the checks that turn bad input into 400s.

Types are enforced by msgspec while decoding, and a field this server does not implement is a
400 naming it (as vLLM and OpenAI do), never silently dropped; ranges and cross-field rules are
checked here, each error naming the offending `param`. Every number a
client sends is bounded here, so nothing out of range reaches the engine or the cluster wire.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.errors import invalid
from gateway.request_log import USABLE_ID

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_LOGIT_BIAS = 300   # entries, as OpenAI allows
MAX_PROMPTS = 128   # prompts in one completions request
MAX_SEQUENCES = 128  # prompts x n: the sequences one request may put in the queue
PRIORITY_RANGE = (-(2 ** 15), 2 ** 15 - 1)
ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    """Every request struct: an unknown field is a 400, not a silently ignored option."""


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(_Body):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None            # a tool message: the call it answers


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: str
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: str
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body, kw_only=True):
    """vLLM's `structured_outputs`: one of these constraints."""
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class StreamOptions(_Body):
    # vLLM's default: with `stream_options` given, usage comes in a last chunk unless turned off.
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None   # vLLM's: usage so far in every chunk as well
    include_obfuscation: bool | None = None   # accepted: our chunks carry no obfuscation padding


class _Common(_Body, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int | None = None
    logit_bias: dict[str, float] | None = None   # token id (as JSON keys are strings) -> bias
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None               # accepted: an end-user id, not used
    safety_identifier: str | None = None  # accepted: OpenAI's successor to `user`, not used
    prompt_logprobs: int | None = None    # vLLM's: each prompt token's logprob and the top k
    # Structured outputs (gateway/structured.py): OpenAI's response_format, vLLM's names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None    # only "xgrammar" (or "auto"): the one engine here
    # vLLM's extensions (the README's table says what each does here).
    cache_salt: str | None = None             # salts this request's prefix-cache blocks
    truncate_prompt_tokens: int | None = None     # keep only the prompt's last k tokens (-1: the context)
    allowed_token_ids: list[int] | None = None    # sample only among these
    bad_words: list[str] | None = None            # never generate these words
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None   # accepted: fast tokenizers add no spaces
    request_id: str | None = None                 # the response's id (an X-Request-Id header wins)
    return_tokens_as_token_ids: bool | None = None    # logprobs name tokens "token_id:<id>"
    add_special_tokens: bool | None = None
    # Refused with the alternative named (REFUSED below): declared so the 400 says why.
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    guided_whitespace_pattern: str | None = None
    mm_processor_kwargs: Any = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Accepted; the chat template decides whether it matters (none of ours reads it).
    reasoning_effort: str | None = None
    # Tool calling (gateway/tools.py).
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template extensions.
    echo: bool | None = None   # the last message's text before the reply, when it is the assistant's
    add_generation_prompt: bool | None = None     # default true
    continue_final_message: bool | None = None    # the last (assistant) message left open
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None   # for templates that render RAG documents
    chat_template: str | None = None   # refused: a template per request runs client code here


class CompletionRequest(_Common, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of those: checked by hand,
    # since msgspec unions hold one array type at most.
    prompt: Any
    logprobs: int | None = None
    best_of: int | None = None   # accepted only where it asks for nothing more than `n`
    echo: bool | None = None     # the prompt before each completion (and its logprobs with `logprobs`)
    suffix: str | None = None    # fill in the middle, before this text (models with FIM tokens)
    prompt_embeds: Any = None    # refused: prompts are token ids or text here


class EmbeddingRequest(_Body, kw_only=True):
    """OpenAI's /v1/embeddings body (and vLLM's truncate_prompt_tokens)."""
    input: Any   # a string, strings, token ids, or lists of token ids: checked as a completion's prompt
    model: str | None = None
    encoding_format: str | None = None   # "float" (default) or "base64" (little-endian float32)
    dimensions: int | None = None        # only the model's own: no Matryoshka truncation here
    user: str | None = None              # accepted: an end-user id, not used
    truncate_prompt_tokens: int | None = None
    priority: int | None = None
    request_id: str | None = None        # vLLM's: the id the request is logged under


def validate_embedding(req: EmbeddingRequest) -> None:
    if req.encoding_format not in (None, "float", "base64"):
        raise invalid(f"`encoding_format` must be float or base64, got {req.encoding_format!r}.",
                      param="encoding_format")
    _range(req.dimensions, "dimensions", 1)
    _range(req.priority, "priority", *PRIORITY_RANGE)
    _truncation_and_id(req)


class TokenizeRequest(_Body, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body, kw_only=True):
    model: str | None = None
    tokens: list[int]


_UNKNOWN = re.compile(r"unknown field `(.*?)`(?: - at `\$\.?(.*)`)?$")
_AT = re.compile(r"- at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `(\w+)`")


def decode(body: bytes, type_: type) -> Any:
    """Decode a JSON body into `type_`, raising a 400 that names the offending field."""
    if not body:
        raise invalid("The request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        msg = str(e)
        if u := _UNKNOWN.search(msg):
            param = f"{u.group(2)}.{u.group(1)}" if u.group(2) else u.group(1)
            raise invalid(f"Unsupported parameter `{param}`: this server does not implement it.",
                          param=param) from None
        m = _AT.search(msg) or _MISSING.search(msg)
        param = m.group(1) if m and m.group(1) else None
        raise invalid(f"Invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise invalid(f"The request body is not valid JSON: {e}") from None
    except RecursionError:   # msgspec's guard against nesting deep enough to overflow the stack
        raise invalid("The request body nests too deeply.") from None


def _range(value, param: str, lo=None, hi=None, lo_open=False) -> None:
    if value is None:
        return
    if value != value or (lo is not None and (value <= lo if lo_open else value < lo)) \
            or (hi is not None and value > hi):
        bound = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
        if hi is not None:
            bound = f"{bound} and <= {hi}" if bound else f"<= {hi}"
        raise invalid(f"`{param}` must be {bound}, got {value}.", param=param)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise invalid(f"At most {MAX_STOP} stop strings are allowed, got {len(stops)}.", param="stop")
    return [s for s in stops if s]


# vLLM's fields that this server cannot honour, refused with the alternative it offers; each
# with the values that ask for nothing (vLLM's defaults), which are accepted.
REFUSED: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((False,), "Beam search is not supported; ask for `n` samples (with "
                                  "`logprobs` to rank them)."),
    "length_penalty": ((1.0,), "`length_penalty` applies to beam search, which is not supported."),
    "logits_processors": (([],), "Custom logits processors are not supported; use `logit_bias`, "
                                 "`allowed_token_ids`, `bad_words` or a structured output."),
    "vllm_xargs": (({},), "No custom request extensions are installed, so `vllm_xargs` has nothing "
                          "to reach."),
    "kv_transfer_params": (({},), "KV transfer is internal here: run engines with `--role prefill` "
                                  "and `--role decode` and the gateway hands requests over."),
    "guided_whitespace_pattern": ((), "JSON is generated without free-running whitespace; for "
                                      "another layout give a grammar in `structured_outputs.grammar`."),
    "mm_processor_kwargs": (({},), "Only text models are served; there is no multimodal processor."),
    "prompt_embeds": ((), "Prompts are text or token ids here; `prompt_embeds` is not supported."),
    "chat_template": ((), "A per-request chat template is not accepted (it would run client code); "
                          "start the server with `--chat-template`."),
}
GUIDED_BACKENDS = ("auto", "xgrammar")
MAX_BAD_WORDS = 64
MAX_WORD_CHARS = 256
MAX_CACHE_SALT_CHARS = 256


def _refused(req) -> None:
    for name, (off, why) in REFUSED.items():
        value = getattr(req, name, None)
        if value is None or any(type(value) is type(o) and value == o for o in off):
            continue
        raise invalid(f"`{name}` is not supported: {why}", param=name)


def validate_common(req: _Common) -> None:
    _refused(req)
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    if req.top_k is not None and req.top_k < -1:
        raise invalid(f"`top_k` must be -1 (off), 0 (off) or positive, got {req.top_k}.", param="top_k")
    _range(req.min_p, "min_p", 0.0, 1.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.repetition_penalty, "repetition_penalty", 0.0, 2.0, lo_open=True)
    _range(req.n, "n", 1, MAX_N)
    _range(req.priority, "priority", *PRIORITY_RANGE)
    _range(req.max_tokens, "max_tokens", 1)
    if req.seed is not None and not -(2 ** 63) <= req.seed < 2 ** 63:
        raise invalid("`seed` must fit in a signed 64-bit integer.", param="seed")
    if req.stream_options is not None and not req.stream:
        raise invalid("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    stop_list(req.stop)
    _range(req.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
    _range(req.min_tokens, "min_tokens", 0)
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP:
        raise invalid(f"At most {MAX_STOP} stop_token_ids are allowed.", param="stop_token_ids")
    if req.logit_bias:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise invalid(f"At most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got "
                          f"{len(req.logit_bias)}.", param="logit_bias")
        for key, bias in req.logit_bias.items():
            if not re.fullmatch(r"\d{1,10}", key):
                raise invalid(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias")
            _range(bias, f"logit_bias.{key}", -100.0, 100.0)
    _validate_extensions(req)


def _validate_extensions(req: _Common) -> None:
    if req.guided_decoding_backend is not None and req.guided_decoding_backend not in GUIDED_BACKENDS:
        raise invalid(f"`guided_decoding_backend` {req.guided_decoding_backend!r} is not available; "
                      "structured outputs use xgrammar here.", param="guided_decoding_backend")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise invalid(f"`cache_salt` must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                      "characters.", param="cache_salt")
    _truncation_and_id(req)
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise invalid("`allowed_token_ids` must not be empty.", param="allowed_token_ids")
    if req.bad_words is not None:
        if len(req.bad_words) > MAX_BAD_WORDS:
            raise invalid(f"At most {MAX_BAD_WORDS} bad_words are allowed, got {len(req.bad_words)}.",
                          param="bad_words")
        for i, w in enumerate(req.bad_words):
            if not w.strip() or len(w) > MAX_WORD_CHARS:
                raise invalid(f"Each bad word must be non-blank and at most {MAX_WORD_CHARS} characters.",
                              param=f"bad_words[{i}]")


def _truncation_and_id(req) -> None:
    """vLLM's `truncate_prompt_tokens` and `request_id`, on the generation and embedding bodies alike."""
    t = req.truncate_prompt_tokens
    if t is not None and t != -1 and t < 1:
        raise invalid(f"`truncate_prompt_tokens` must be -1 (the context length) or at least 1, got {t}.",
                      param="truncate_prompt_tokens")
    if req.request_id is not None and not USABLE_ID.fullmatch(req.request_id):   # as an X-Request-Id
        raise invalid("`request_id` must be 1-128 printable characters without spaces.", param="request_id")


def token_ids_checked(ids, vocab_size: int, param: str) -> None:
    """Token ids a request names (logit_bias keys, stop_token_ids) against the vocabulary."""
    for t in ids:
        if not 0 <= int(t) < vocab_size:
            raise invalid(f"Token id {t} in `{param}` is outside the vocabulary [0, {vocab_size}).",
                          param=param)


# apply_chat_template's own parameters: `chat_template_kwargs` may not reach them.
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "chat_template", "tokenize", "padding",
                            "truncation", "max_length", "return_tensors", "return_dict",
                            "return_assistant_tokens_mask", "tokenizer_kwargs", "add_special_tokens")


def validate_chat(req: ChatRequest) -> None:
    validate_common(req)
    if req.continue_final_message and req.add_generation_prompt is not False:   # vLLM: default true
        raise invalid("`continue_final_message` leaves the last message open; it cannot be combined "
                      "with `add_generation_prompt`, set it to false.", param="continue_final_message")
    for key in req.chat_template_kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise invalid(f"`chat_template_kwargs` may not set {key!r}.", param=f"chat_template_kwargs.{key}")
    _range(req.max_completion_tokens, "max_completion_tokens", 1)
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise invalid(f"`reasoning_effort` must be one of {', '.join(REASONING_EFFORTS)}.",
                      param="reasoning_effort")
    if not req.messages:
        raise invalid("`messages` must hold at least one message.", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise invalid(f"Unknown role {m.role!r} in messages[{i}]; expected one of "
                          f"{', '.join(ROLES)}.", param=f"messages[{i}].role")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"Only text content parts are supported, got {part.type!r}.",
                                  param=f"messages[{i}].content[{j}]")
        elif m.content is None and m.role != "assistant":
            raise invalid(f"messages[{i}] has no content.", param=f"messages[{i}].content")
        if m.role == "tool" and not m.tool_call_id:
            raise invalid(f"messages[{i}] is a tool message without `tool_call_id`.",
                          param=f"messages[{i}].tool_call_id")
        if m.tool_calls is not None and m.role != "assistant":
            raise invalid(f"Only assistant messages carry `tool_calls`, messages[{i}] is {m.role!r}.",
                          param=f"messages[{i}].tool_calls")
    if req.top_logprobs is not None:
        _range(req.top_logprobs, "top_logprobs", 0, MAX_LOGPROBS)
        if not req.logprobs:
            raise invalid("`top_logprobs` requires `logprobs` to be true.", param="top_logprobs")


def message_text(m: ChatMessage) -> str:
    if isinstance(m.content, list):
        return "".join(p.text or "" for p in m.content)
    return m.content or ""


def validate_completion(req: CompletionRequest) -> None:
    validate_common(req)
    _range(req.logprobs, "logprobs", 0, MAX_LOGPROBS)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise invalid("`best_of` other than `n` is not supported.", param="best_of")
    if req.echo and req.suffix is not None:
        raise invalid("`echo` cannot be combined with `suffix`.", param="echo")


def completion_prompts(prompt: Any, vocab_size: int, param: str = "prompt") -> list[str | list[int]]:
    """Normalise `prompt` (the body's `param`) into a list of strings and token-id lists, checking each."""
    def ids_ok(xs: list) -> bool:
        return all(type(x) is int for x in xs)

    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and ids_ok(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and ids_ok(p)) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid(f"`{param}` must be a string, a list of strings, a list of token ids, "
                      "or a list of token-id lists, and not empty.", param=param)
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"At most {MAX_PROMPTS} prompts per request, got {len(prompts)}.", param=param)
    for p in prompts:
        if len(p) == 0:
            raise invalid(f"`{param}` must not be empty.", param=param)
        if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
            raise invalid(f"Token ids in `{param}` must be in [0, {vocab_size}).", param=param)
    return prompts
