"""A model's chat template, rendered as transformers renders it (apply_chat_template), and the
characters of the rendered text that the loss is on: the assistant's turns, or a completion.

transformers compiles tokenizer_config.json's `chat_template` (or chat_template.jinja beside it,
transformers >= 4.43) with jinja2 in an immutable sandbox, trim_blocks and lstrip_blocks, the
loopcontrols extension, a `tojson` filter that keeps non-ASCII, the globals raise_exception and
strftime_now, and a {% generation %} ... {% endgeneration %} block that renders its body unchanged
(transformers' marker of the assistant's tokens for return_assistant_tokens_mask); the variables are the messages, add_generation_prompt and the special tokens. This
module does the same with jinja2 alone (no transformers, no torch): what a template renders here is
what transformers renders, which tools/checks/hf_roundtrip_check.py checks where transformers is.

The assistant's span of message k is found by rendering: the conversation up to k with the
generation prompt, then up to and including k; what the second adds to the first is the
assistant's text (its content and the template's end-of-turn after it, so the model learns to end
its turn). A template that renders earlier messages differently once later ones follow is refused:
its spans cannot be told.
"""
import datetime
import json
import os


class TemplateError(Exception):
    pass


def load(tokenizer_json):
    """(template source, special tokens {bos_token: str, eos_token: str, ...}) of the model whose
    tokenizer.json is `tokenizer_json`: chat_template.jinja beside it, else tokenizer_config.json's
    chat_template (a string, or a list of named templates of which "default" is taken)."""
    folder = os.path.dirname(os.path.abspath(tokenizer_json))
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise TemplateError(f"{config_path}: cannot be read: {e}")
    specials = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            specials[key] = value
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), specials
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise TemplateError(f"{folder}: no chat template (neither chat_template.jinja nor a "
                            "chat_template in tokenizer_config.json)")
    return template, specials


def compile_template(source):
    try:
        from jinja2 import nodes
        from jinja2.exceptions import TemplateError as JinjaError
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TemplateError("the Python package 'jinja2' is needed: pip install jinja2")

    class Generation(Extension):
        """{% generation %}BODY{% endgeneration %} renders BODY: the spans come from rendering
        prefixes (conversation() below), so the marks are not needed to find them."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise TemplateError(f"the chat template refused the conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except JinjaError as e:
        raise TemplateError(f"the chat template does not compile: {e}")


def render(template, specials, messages, add_generation_prompt):
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **specials)
    except TemplateError:
        raise
    except Exception as e:  # jinja2's own errors
        raise TemplateError(f"the chat template failed: {e}")


def conversation(template, specials, record):
    """(text, [(begin, end), ...]): the rendered record and the character spans its loss is on.
    `record` holds "messages" (the assistant's turns are trained) or "prompt" and "completion"
    (strings: the completion; lists of messages: rendered as one conversation, the completion's
    messages trained)."""
    if "messages" in record:
        messages, trained = record["messages"], None
    elif isinstance(record["prompt"], str):
        prompt, completion = record["prompt"], record["completion"]
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))]
    else:
        messages = record["prompt"] + record["completion"]
        trained = range(len(record["prompt"]), len(messages))
    text = render(template, specials, messages, False)
    spans = []
    for k, m in enumerate(messages):
        if (m["role"] != "assistant") if trained is None else (k not in trained):
            continue
        before = render(template, specials, messages[:k], True)
        upto = render(template, specials, messages[:k + 1], False)
        if not upto.startswith(before) or not text.startswith(upto):
            raise TemplateError(
                f"messages[{k}]: the chat template renders the conversation before it differently"
                " once it follows, so its tokens cannot be told apart")
        if spans and spans[-1][1] == len(before):
            spans[-1] = (spans[-1][0], len(upto))
        else:
            spans.append((len(before), len(upto)))
    return text, spans
