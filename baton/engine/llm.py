"""The offline API, as vLLM names it: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, cast

from baton.engine.config import EngineArgs
from baton.engine.core import EngineCore
from baton.engine.generation_config import check_source, sampling_defaults
from baton.engine.output_processor import OutputProcessor
from baton.engine.outputs import RequestOutput
from baton.engine.processor import check_prompt_token_ids, child_requests
from baton.engine.protocol import EngineCoreRequest
from baton.engine.sampling_params import SamplingParams
from baton.tokenizer import Tokenizer, load_tokenizer

PromptType = str | dict[str, Any]


class LLM:
    """Runs an engine in this process and generates for batches of prompts."""

    def __init__(
        self,
        model: str | None = None,
        *,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **engine_args: Any,
    ) -> None:
        """`generation_config` and its override choose `get_default_sampling_params` as vLLM's
        options of the same names do (baton.engine.generation_config)."""
        check_source(generation_config)
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.engine = EngineCore(self.engine_args)
        self.tokenizer = load_tokenizer(
            self.engine_args.tokenizer or self.engine.model_path, self.engine_args.chat_template
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        self._sampling_defaults = sampling_defaults(
            self.engine.model_path, generation_config, override_generation_config
        )

    def shutdown(self) -> None:
        """Stops the engine's worker processes, if it has any (also done when collected)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no params: the model's generation config's
        fields, vLLM's defaults for the rest."""
        return SamplingParams(**self._sampling_defaults)

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache; False, changing nothing, while a request holds blocks."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in input order.

        Every prompt is checked before any is queued, so one bad prompt fails the call with a
        `ValueError` naming it and leaves the engine untouched; so are the token ids its params
        carry (logit_bias, allowed_token_ids, bad_words_token_ids). The whole sampling surface
        (docs/sampling.md) goes to the engine as given, `prompt_logprobs` and
        `include_stop_str_in_output` included. A dict prompt may carry a `cache_salt` (vLLM's
        prompt key): prompts with different salts never share prefix-cache blocks.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(params_list)} sampling params"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        inputs = [self._tokenize(p, i) for i, p in enumerate(prompts)]
        salts = [_cache_salt(p, i) for i, p in enumerate(prompts)]
        vocab_size = self.engine.model_config.vocab_size
        for i, ((_, ids), params) in enumerate(zip(inputs, params_list, strict=True)):
            try:
                check_prompt_token_ids(ids, self.engine.max_model_len, vocab_size)
                _check_sampling_token_ids(params, vocab_size)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        request_ids = []
        for (text, ids), params, prio, salt in zip(
            inputs, params_list, priorities, salts, strict=True
        ):
            request_ids.append(self._add_request(text, ids, params, prio, salt))
        return self._run(request_ids)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, through the chat template.
        `continue_final_message` goes on with each conversation's last message (as vLLM's,
        with `add_generation_prompt=False`)."""
        conversations = cast(
            "list[list[dict[str, Any]]]",
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        prompts: list[PromptType] = [
            {
                "prompt_token_ids": self.tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    continue_final_message=continue_final_message,
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _tokenize(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            text = prompt.get("prompt")
        else:
            raise ValueError(
                f"prompt {index} must be a str or a dict with 'prompt_token_ids', got {prompt!r}"
            )
        return text, ids

    def _add_request(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None = None,
    ) -> str:
        request_id = str(next(self._counter))
        children = child_requests(request_id, params)
        self.output_processor.add_request(request_id, text, ids, [c for c, _ in children], params)
        group = request_id if params.n > 1 else None
        now = time.time()
        for child_id, child_params in children:
            self.engine.add_request(
                EngineCoreRequest(
                    child_id, ids, child_params, now, priority, group, cache_salt=cache_salt
                )
            )
        return request_id

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        wanted = set(request_ids)
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests() and len(results) < len(wanted):
            step = self.engine.step()
            if step is None:
                continue
            updates, to_abort = self.output_processor.process_outputs(step.outputs)
            if to_abort:
                self.engine.abort_requests(to_abort)
            for output in updates:
                if output.finished:
                    results[output.request_id] = output
        return [results[r] for r in request_ids]


def _cache_salt(prompt: PromptType, index: int) -> str | None:
    """A dict prompt's `cache_salt`, checked as the API checks it."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"prompt {index}: cache_salt must be a non-empty string")
    return salt


def _check_sampling_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raises ValueError naming the field when a token id in the params is outside the vocab.

    vLLM rejects these at its processor too (out-of-vocab logit_bias and allowed_token_ids);
    the engine would otherwise drop them silently.
    """
    fields: list[tuple[str, list[int]]] = [
        ("logit_bias", list(params.logit_bias or {})),
        ("allowed_token_ids", list(params.allowed_token_ids or [])),
        ("bad_words_token_ids", [t for word in params.bad_words_token_ids for t in word]),
    ]
    for name, ids in fields:
        bad = sorted({t for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(f"{name} has token ids outside [0, {vocab_size}): {bad[:5]}")
