"""A model folder's tokenizer on the `tokenizers` library alone, with its chat template rendered
as transformers renders it. Neither transformers nor torch is imported, so the API server process
that tokenizes prompts stays a light front end."""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, models, processors
from tokenizers import Tokenizer as Backend

logger = logging.getLogger(__name__)

ChatTemplate = str | dict[str, str]  # one template, or several by name ("default", "tool_use")


class Tokenizer:
    """Encodes, decodes and renders chat prompts; the defaults follow transformers' tokenizers.

    `backend` is the `tokenizers.Tokenizer` itself (the detokenizer streams through it);
    `special_tokens` maps names such as `bos_token` to their text, as the template sees them.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        # A named special token the tokenizer.json lacks is added as a special token (as
        # transformers does), so it is one token in prompts and skipped by skip_special_tokens.
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in self.special_tokens.values() if t not in added]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        # How the decoder turns pieces into bytes (`token_bytes`): GPT-2's byte-level alphabet,
        # or SentencePiece's `<0xNN>` pieces.
        decoder = backend.decoder.__getstate__() if backend.decoder is not None else b""
        self._byte_level = b'"ByteLevel"' in decoder
        self._byte_fallback = b'"ByteFallback"' in decoder

    def to_wire(self) -> dict[str, Any]:
        """The tokenizer as JSON-able data (`from_wire` rebuilds it): what an engine serves the
        router, which tokenizes prompts as the engine does without reading the model's files."""
        return {
            "tokenizer_json": self.backend.to_str(),
            "special_tokens": self.special_tokens,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer `to_wire` described; ValueError when `data` is not such a description."""
        try:
            backend = Backend.from_str(data["tokenizer_json"])
            special = {str(k): str(v) for k, v in dict(data.get("special_tokens") or {}).items()}
            template = data.get("chat_template")
        except Exception as e:
            raise ValueError(f"not a tokenizer description: {e}") from None
        if not (template is None or isinstance(template, str | dict)):
            raise ValueError("chat_template must be a string, an object or null")
        return cls(backend, special_tokens=special, chat_template=template)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without added tokens (transformers' `vocab_size`)."""
        return int(self.backend.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprob `bytes`). A token that is only part of
        a UTF-8 character decodes to U+FFFD; its own bytes come from its piece, where the decoder
        says how: `<0xNN>` (byte fallback) or byte-level BPE's alphabet, one character a byte."""
        text = self.decode([token])
        piece = self.backend.id_to_token(token) if "\ufffd" in text else None
        if piece is None:
            return text.encode()
        if self._byte_fallback and (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode()

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens = []
        for i in ids:
            token = self.backend.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is not in the vocabulary")
            tokens.append(token)
        return tokens

    # The overloads say only what `tokenize` returns; the implementation names the rest.
    @overload
    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, tokenize: Literal[True] = ..., **kwargs: Any
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, tokenize: Literal[False], **kwargs: Any
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int] | str:
        """A conversation rendered by the chat template: its token ids, or the text.

        `chat_template` is a template, or a name among the model's templates; `kwargs` reach the
        template beside the special tokens (they win on a clash). The text's ids carry no extra
        special tokens: the template writes those it wants. `continue_final_message` (as in
        transformers, and not with `add_generation_prompt`) leaves the last message open, so
        that the model goes on from its text: what the template writes after that text (an
        end-of-turn token, say) is cut off. A ValueError says why a conversation cannot be
        rendered so.
        """
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages
        ):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be set: the first "
                "goes on with the last message, the second opens a new assistant message"
            )
        source = self._pick_template(chat_template, tools)
        template = _compile(source)
        # As in transformers: a None field is left out (templates test for missing keys, and
        # would render "None"), and tools and documents are always defined, None when absent.
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if any(m["role"] == "developer" for m in conversation) and not _knows_developer(source):
            conversation = _developer_as_system(conversation)
        if continue_final_message:
            _mark_final_message(conversation)
        text = template.render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        if continue_final_message:
            text = _cut_after_final_message(text)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _pick_template(self, chat_template: str | None, tools: list[Any] | None) -> str:
        named = self.chat_template if isinstance(self.chat_template, dict) else {}
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if isinstance(self.chat_template, str):
            return self.chat_template
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        if named:
            raise ValueError(
                f"the model has several chat templates and none named default: {sorted(named)}"
            )
        raise ValueError("the model's tokenizer has no chat template")


def _knows_developer(template: str) -> bool:
    """Whether a template names OpenAI's `developer` role (vLLM's test: the quoted name)."""
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM renders for a template that knows no `developer` role: developer messages
    become system ones (without their `tools`), and when that leaves a system message past
    the first place, or several, their texts join ("\n\n") in one system message first."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in conversation
    ]
    positions = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if positions in ([], [0]):
        return converted
    texts = [_text_of(converted[i].get("content", "")) for i in positions]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def _text_of(content: Any) -> str:
    """A message's content as text: a list of parts joins its text parts ("\n")."""
    if not isinstance(content, list):
        return str(content)
    parts = [p["text"] if isinstance(p, dict) else p for p in content]
    return "\n".join(p for p in parts if isinstance(p, str))


# Marks where the final message's text ends, for `continue_final_message`: the space after it
# shows whether the template kept the text's trailing whitespace.
_CONTINUE_TAG = "BATON_CONTINUE_FINAL_MESSAGE"


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_spelling() -> dict[int, str]:
    """Byte-level BPE's spelling of bytes (GPT-2's `bytes_to_unicode`), which its vocabularies
    are written in: printable bytes are their own character, the rest shifted past U+0100 in
    order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return spelling


_BYTE_LEVEL = {c: b for b, c in byte_level_spelling().items()}  # character -> byte


def _mark_final_message(conversation: list[dict[str, Any]]) -> None:
    """Appends the tag to the last message's text (its content, or the last text part of it),
    in copies: the caller's messages stay as they were."""
    if not conversation:
        raise ValueError("continue_final_message needs a message to continue")
    final = conversation[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG + " "
        return
    if isinstance(content, list):
        for i in reversed(range(len(content))):
            part = content[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                final["content"] = [
                    *content[:i],
                    {**part, "text": part["text"] + _CONTINUE_TAG + " "},
                    *content[i + 1 :],
                ]
                return
    raise ValueError("continue_final_message needs a final message with text to continue")


def _cut_after_final_message(text: str) -> str:
    """The rendered text up to the end of the final message's text (`_mark_final_message`):
    where the template trimmed the text's trailing whitespace, without it too."""
    at = text.rfind(_CONTINUE_TAG)
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not write the final message's "
            "text as it is, so it cannot be continued"
        )
    if text.startswith(_CONTINUE_TAG + " ", at):
        return text[:at]
    return text[:at].rstrip()


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder: `tokenizer.json`, `tokenizer_config.json`
    (special tokens, `add_bos_token`, ...) and the chat template (`chat_template.jinja` and
    `additional_chat_templates/`, else `chat_template.json`, else the tokenizer config's), unless
    `chat_template` (the engine's `--chat-template`) replaces it."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no tokenizer.json")
    backend = Backend.from_file(str(path / "tokenizer.json"))
    config = _read_json(path / "tokenizer_config.json")
    special: dict[str, str] = {}
    # Every `*_token` entry is a named special token (transformers 5 passes model-specific ones
    # such as `image_token` to the template too); the config wins over the legacy map.
    for key, value in {**_read_json(path / "special_tokens_map.json"), **config}.items():
        text = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(text, str):
            special[key] = text
    tokenizer = Tokenizer(
        backend,
        special_tokens=special,
        chat_template=chat_template or _read_chat_template(path, config),
    )
    if config.get("clean_up_tokenization_spaces") and not isinstance(backend.model, models.BPE):
        # transformers would drop WordPiece-style spaces before punctuation here (it skips BPE
        # models); a decode stream cannot, and decoded and streamed text must agree (as vLLM).
        logger.warning("%s: clean_up_tokenization_spaces is not applied", path)
    # The tokenizer.json's post-processor is the model's own; only without one do the config's
    # add_bos_token / add_eos_token say which special tokens frame an encoded text.
    bos = special.get("bos_token") if config.get("add_bos_token") else None
    eos = special.get("eos_token") if config.get("add_eos_token") else None
    if backend.post_processor is None and (bos or eos):
        edges = [t for t in (bos, eos) if t]
        backend.post_processor = processors.TemplateProcessing(
            single=([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []),
            special_tokens=[(t, backend.token_to_id(t)) for t in edges],
        )
    return tokenizer


def chat_template_of(path: str | Path, chat_template: str | None = None) -> ChatTemplate | None:
    """The chat template(s) `load_tokenizer(path, chat_template)` serves."""
    path = Path(path)
    return chat_template or _read_chat_template(path, _read_json(path / "tokenizer_config.json"))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _read_chat_template(path: Path, config: dict[str, Any]) -> ChatTemplate | None:
    templates = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    for file in sorted((path / "additional_chat_templates").glob("*.jinja")):
        templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    found = _read_json(path / "chat_template.json").get("chat_template") or config.get(
        "chat_template"
    )
    if isinstance(found, list):  # the config's form of several named templates
        return {t["name"]: t["template"] for t in found}
    return found if isinstance(found, (str, dict)) else None


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; a
    prompt renders the body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads the base class's set attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys: wrong for a prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    # A function rather than the `dict` type, which the template could otherwise inspect.
    return dict(*args, **kwargs)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """A chat template compiled in a sandbox (templates come from model folders and requests)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _dict
    return env.from_string(template)
