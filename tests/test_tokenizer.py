"""The torch-free `Tokenizer` against transformers, the oracle: encode, decode and rendered chat
prompts are equal, for Baton's tiny models, a Llama-2-style tokenizer and (when installed)
SmolLM2's; chat template files are found where transformers finds them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer

from baton.engine.models.tiny import ARCHITECTURES, CHAT_TEMPLATE
from baton.tokenizer import Tokenizer, load_tokenizer
from tests.engine.tokenizer_folders import smollm2_folder, spiece_folder

TEXTS = [
    "",
    "Hello world",
    "The relay passed the baton quickly, 42 times!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\n\n",
    "naïve café ünïcødé ✓ 漢字 日本語 🎉👩‍👩‍👧",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "<s>llama's own</s> markers",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is a baton?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a relay race."},
        {"role": "assistant", "content": "  The 4x100 m.  "},
        {"role": "user", "content": "And a longer one? ✓ 漢字"},
    ],
    [
        {"role": "user", "content": "Hi", "name": None},  # a None field is left out
        {"role": "assistant", "content": "Hello! 🎉"},
    ],
]

# A template that reaches every feature transformers gives templates: trimmed blocks, the
# special tokens, namespace, loop controls, tojson, raise_exception, strftime_now, tools and
# documents (always defined), extra keyword arguments, and the {% generation %} tag.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(has_system=false) %}
{% if tools is not none %}
<tools>{{ tools | tojson }}</tools>
{% endif %}
{% if documents is defined and documents is none %}(no documents){% endif %}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + m['role']) }}
    {% endif %}
    {% if loop.index0 >= max_turns | default(50) %}{% break %}{% endif %}
    {% if m['role'] == 'system' %}{% set ns.has_system = true %}{% endif %}
    {% set who = m['role'] | upper ~ (':' ~ m['name'] if m['name'] is defined else '') %}
    [{{ who }}] {{ m['content'] | trim }}
    {% if m['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}

{% endfor %}
{% if not ns.has_system and default_system is defined %}(system: {{ default_system }}){% endif %}
{{ {'é': 'ü', 'n': [1, 2], 'a': '<b>'} | tojson }} {{ strftime_now('%Y') }}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""


def _folders(request: pytest.FixtureRequest, name: str) -> Path:
    root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if name == "spiece":
        return spiece_folder(root)
    if name == "smollm2":
        return smollm2_folder(root)
    return Path(request.getfixturevalue("tiny_model")(name))


FOLDERS = [*ARCHITECTURES, "spiece", "smollm2"]


def _assert_same_tokens(ours: Tokenizer, ref: Any) -> None:
    rng = random.Random(0)
    assert ours.vocab_size == ref.vocab_size and len(ours) == len(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    id_lists = [ours.encode(t) for t in TEXTS]
    id_lists += [[rng.randrange(len(ours)) for _ in range(rng.randint(1, 30))] for _ in range(30)]
    for ids in id_lists:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
        assert ours.decode(ids) == ref.decode(ids)  # the same default (special tokens shown)


@pytest.mark.parametrize("name", FOLDERS)
def test_encode_decode_equal_transformers(request: pytest.FixtureRequest, name: str) -> None:
    """encode (with and without special tokens), decode (with and without skipping them) and
    token strings equal transformers' on prompts, Unicode, emoji and random ids."""
    folder = _folders(request, name)
    _assert_same_tokens(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


def _assert_same_chat(ours: Tokenizer, ref: Any, **kwargs: Any) -> None:
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = ours.apply_chat_template(
                conv, add_generation_prompt=gen, tokenize=False, **kwargs
            )
            expected = ref.apply_chat_template(
                conv, add_generation_prompt=gen, tokenize=False, **kwargs
            )
            assert text == expected, (conv, gen)
            ids = ours.apply_chat_template(conv, add_generation_prompt=gen, **kwargs)
            assert ids == ref.apply_chat_template(
                conv, add_generation_prompt=gen, return_dict=False, **kwargs
            )


@pytest.mark.parametrize("name", FOLDERS)
def test_chat_prompts_equal_transformers(request: pytest.FixtureRequest, name: str) -> None:
    """Each model's own chat template renders (and tokenizes) several conversations exactly as
    transformers does, with and without the generation prompt."""
    folder = _folders(request, name)
    _assert_same_chat(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


# Conversations whose last message goes on: with trailing spaces (which a template may trim),
# and as content parts.
CONTINUED: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A ripe"}],
    [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "The 4x100 m.  "}],
    [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "漢字 ✓ "}],
    [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two "}],
        },
    ],
    [{"role": "user", "content": "Finish my sentence: the baton"}],
]
# A template that trims each message's text, as many do, and one that writes content parts.
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PARTS_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}</s>{% endfor %}"
)


@pytest.mark.parametrize("name", ["llama", "smollm2", "spiece"])
def test_continue_final_message_equals_transformers(
    request: pytest.FixtureRequest, name: str
) -> None:
    """`continue_final_message` leaves the last message open exactly as transformers does:
    the text after it cut off, the trailing whitespace the template trims gone too, content
    parts continued from their last text; and it is refused with the generation prompt."""
    folder = _folders(request, name)
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    strings = [c for c in CONTINUED if isinstance(c[-1]["content"], str)]
    for template, conversations in (
        (None, strings),
        (TRIMMING_TEMPLATE, strings),
        (PARTS_TEMPLATE, CONTINUED),
    ):
        for conv in conversations:
            kwargs: dict[str, Any] = {"chat_template": template, "continue_final_message": True}
            text = ours.apply_chat_template(conv, tokenize=False, **kwargs)
            assert text == ref.apply_chat_template(conv, tokenize=False, **kwargs), (conv, template)
            assert not text.endswith(("</s>", "<|im_end|>", "<|im_end|>\n"))
            ids = ours.apply_chat_template(conv, **kwargs)
            assert ids == ref.apply_chat_template(conv, return_dict=False, **kwargs)
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(
            CONTINUED[0], add_generation_prompt=True, continue_final_message=True
        )
    no_text = [{"role": "assistant", "content": None, "tool_calls": []}]
    with pytest.raises(ValueError, match="text to continue"):
        ours.apply_chat_template(no_text, continue_final_message=True)
    dropping = "{% for m in messages %}{{ m.role }}{% endfor %}"  # never writes the text
    with pytest.raises(ValueError, match="cannot be continued"):
        ours.apply_chat_template(CONTINUED[0], chat_template=dropping, continue_final_message=True)


def test_rich_template_equals_transformers(tiny_model) -> None:
    """A template using every feature transformers offers (special tokens, namespace, loop
    controls, tojson, strftime_now, tools, extra kwargs, {% generation %}) renders the same."""
    folder = tiny_model("qwen2")
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    tools = [{"type": "function", "function": {"name": "pass_baton", "description": "é <x>"}}]
    for kwargs in (
        {},
        {"tools": tools},
        {"default_system": "Be kind.", "max_turns": 2},
        {"bos_token": "<override>"},  # keyword arguments win over the special tokens
    ):
        _assert_same_chat(ours, ref, chat_template=RICH_TEMPLATE, **kwargs)


def test_raise_exception_and_bad_messages(tiny_model) -> None:
    """raise_exception() in a template raises its message as transformers does; messages that
    are not role dicts and a model without a template are clear ValueErrors."""
    folder = tiny_model("llama")
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    bad = [{"role": "robot", "content": "beep"}]
    for tok in (ours, ref):
        with pytest.raises(jinja2.TemplateError, match="unknown role: robot"):
            tok.apply_chat_template(bad, chat_template=RICH_TEMPLATE, tokenize=False)
    with pytest.raises(ValueError, match="list of"):
        ours.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(ours.backend).apply_chat_template(CONVERSATIONS[0])


def test_a_developer_message_is_a_system_one_where_the_template_knows_no_developer(
    tiny_model,
) -> None:
    """OpenAI's `developer` role, as vLLM renders it: for a template that does not name it, a
    system message, with every system message merged into one first; a template that names it
    gets it as it is."""
    ours = load_tokenizer(tiny_model("qwen2"))
    plain = "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "dev", "tools": [{"x": 1}]},
        {
            "role": "system",
            "content": [{"type": "text", "text": "sys"}, {"type": "text", "text": "2"}],
        },
    ]
    rendered = ours.apply_chat_template(messages, chat_template=plain, tokenize=False)
    assert rendered == "[system: dev\n\nsys\n2][user: hi]"
    first = [{"role": "developer", "content": "be nice"}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(first, chat_template=plain, tokenize=False) == (
        "[system: be nice][user: hi]"
    )
    knows = (
        "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}"
        "[{{ m.role }}]{% endfor %}"
    )
    assert ours.apply_chat_template(messages, chat_template=knows, tokenize=False) == (
        "[user]D[developer][system]"
    )
    ordinary = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    assert ours.apply_chat_template(ordinary, chat_template=plain, tokenize=False) == (
        "[user: a][system: late]"
    )


@pytest.mark.parametrize("name", FOLDERS)
def test_token_bytes_join_into_the_texts_utf8(request: pytest.FixtureRequest, name: str) -> None:
    """A token that is part of a character has its own bytes (OpenAI's logprob `bytes`), not
    U+FFFD's: joined over a byte-level encoding, the tokens' bytes are the text's UTF-8; a
    byte-fallback piece (`<0xNN>`) is its byte; a whole token's bytes are its text's."""
    ours = load_tokenizer(_folders(request, name))
    text = "emoji 🙂🚀 and 中文, naïve 🧑‍🚀"
    ids = ours.encode(text, add_special_tokens=False)
    pieces = ours.convert_ids_to_tokens(ids)
    partial = [i for i in ids if "\ufffd" in ours.decode([i])]
    for token, piece in zip(ids, pieces, strict=True):
        if piece.startswith("<0x") and piece.endswith(">"):
            assert ours.token_bytes(token) == bytes([int(piece[3:5], 16)])
        elif token not in partial:
            assert ours.token_bytes(token) == ours.decode([token]).encode()
    byte_level = all(len(p) > 0 and not p.startswith("▁") for p in pieces) and partial
    if byte_level and not any(p.startswith("<0x") for p in pieces):
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
    for token in partial:
        assert b"\xef\xbf\xbd" not in ours.token_bytes(token)


def _copy_tokenizer(src: Path, dst: Path, **config: Any) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    base = json.loads((src / "tokenizer_config.json").read_text())
    base.update(config)
    base = {k: v for k, v in base.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(base))
    return dst


def test_template_files_as_transformers_finds_them(tiny_model, tmp_path: Path) -> None:
    """chat_template.jinja overrides the config's template; additional_chat_templates/ and a
    config list give named templates (default, tool_use, or one by name), as in transformers."""
    src = tiny_model("llama")
    folder = _copy_tokenizer(src, tmp_path / "jinja")
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.chat_template == ref.chat_template == RICH_TEMPLATE
    _assert_same_chat(ours, ref)

    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(CHAT_TEMPLATE + "TOOLS")
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.chat_template == ref.chat_template
    _assert_same_chat(ours, ref)
    _assert_same_chat(ours, ref, tools=[{"name": "t"}])
    _assert_same_chat(ours, ref, chat_template="tool_use")

    listed = [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "terse", "template": "T"}]
    folder = _copy_tokenizer(src, tmp_path / "listed", chat_template=listed)
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.chat_template == ref.chat_template == {"default": CHAT_TEMPLATE, "terse": "T"}
    _assert_same_chat(ours, ref, chat_template="terse")
    _assert_same_chat(ours, ref)


def test_chat_template_json_is_read(tiny_model, tmp_path: Path) -> None:
    """A folder whose template lives only in chat_template.json (multimodal models' processor
    file, which vLLM reads too) gets that template."""
    folder = _copy_tokenizer(tiny_model("llama"), tmp_path / "json", chat_template=None)
    (folder / "chat_template.json").write_text(
        json.dumps({"chat_template": "J{{ messages[0].content }}"})
    )
    assert load_tokenizer(folder).apply_chat_template(CONVERSATIONS[0], tokenize=False) == (
        "JWhat is a baton?"
    )


def test_add_bos_token_without_a_post_processor(tiny_model, tmp_path: Path) -> None:
    """The tiny tokenizer.json has no post-processor: add_bos_token / add_eos_token in the
    config then frame an encoded text, and only when special tokens are asked for."""
    folder = _copy_tokenizer(
        tiny_model("llama"), tmp_path / "bos", add_bos_token=True, add_eos_token=True
    )
    tok = load_tokenizer(folder)
    plain = tok.encode("hi there", add_special_tokens=False)
    assert tok.encode("hi there") == [0, *plain, 2]  # <|endoftext|> is bos, <|im_end|> eos
    assert load_tokenizer(tiny_model("llama")).encode("hi there") == plain


def test_missing_special_token_is_added(tiny_model, tmp_path: Path) -> None:
    """A named special token the tokenizer.json lacks becomes one special token, as
    transformers adds it: encoded whole, skipped by skip_special_tokens."""
    folder = _copy_tokenizer(tiny_model("llama"), tmp_path / "extra", pad_token="<|pad|>")
    ours, ref = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    ids = ours.encode("a<|pad|>b")
    assert ids == ref.encode("a<|pad|>b") and len(ours) == len(ref) == 513
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_unknown_id_and_missing_folder(tiny_model, tmp_path: Path) -> None:
    """An id outside the vocabulary has no token string; a folder without tokenizer.json is a
    FileNotFoundError naming it."""
    tok = load_tokenizer(tiny_model("llama"))
    with pytest.raises(ValueError, match="99999"):
        tok.convert_ids_to_tokens([1, 99999])
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_no_torch_or_transformers_imported(tiny_model) -> None:
    """Loading a tokenizer, rendering a chat prompt and streaming its detokenization import
    neither torch nor transformers (checked in a fresh interpreter)."""
    code = (
        "import sys\n"
        "from baton.tokenizer import load_tokenizer\n"
        "from baton.engine.detokenizer import IncrementalDetokenizer\n"
        f"t = load_tokenizer({str(tiny_model('llama'))!r})\n"
        "chat = [{'role': 'user', 'content': 'hi'}]\n"
        "ids = t.apply_chat_template(chat, add_generation_prompt=True)\n"
        "d = IncrementalDetokenizer(t, ['x'], prompt_token_ids=ids)\n"
        "d.update(t.encode('hello there'))\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules, repr(d.text))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "False False 'hello there'"
