"""Model runner: one forward pass over a mixed batch per `SchedulerOutput`, then sampling."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from baton.engine.layers.attention import (
    AttentionMetadata,
    AttentionSpec,
    make_attention_backend,
)
from baton.engine.layers.cpu_linear import pack_linears
from baton.engine.models.config import ModelConfig
from baton.engine.models.loader import load_model
from baton.engine.models.tensor_parallel import TensorParallel
from baton.engine.protocol import LogprobsEntry
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from baton.engine.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    gather_logprobs,
)

logger = logging.getLogger(__name__)

# Prompt logprobs take the full-vocabulary logits of every prompt position; this many positions
# at a time bounds that memory (rows x vocab float32) whatever the chunk size.
_PROMPT_LOGPROBS_ROWS = 256
# Prompt logprobs of one chunk, on the device: (first prompt position predicted, [m, k+1] ids,
# [m, k+1] logprobs, [m] ranks).
PromptLogprobsChunk = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class RunnerConfig:
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    attention_backend: str
    seed: int


@dataclass
class CachedRequestState:
    """What the worker keeps per request between steps (it appends its own samples)."""

    req_id: str
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None
    num_computed_tokens: int = 0  # in the cache before this step: this step runs from here
    num_pending: int = 0  # sampled on the device, not yet appended to token_ids
    # Prompt logprobs computed so far, chunk by chunk, still on the device.
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    # Built once from the sampling params, for the logits' width (ids past it are dropped).
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None
    allowed_mask: torch.Tensor | None = None  # [V] bool on the device, True = allowed
    banned: list[int] = field(default_factory=list)  # one-token bad words: always forbidden
    bad_words: list[list[int]] = field(default_factory=list)  # longer ones: need the output

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def in_prompt(self) -> bool:
        """Still computing the prompt: nothing sampled yet, not even on the device."""
        return self.num_pending == 0 and len(self.token_ids) == self.num_prompt_tokens


def _uses_penalties(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _needs_history(p: SamplingParams) -> bool:
    """Whether sampling reads the request's past output tokens on the host."""
    return _uses_penalties(p) or any(len(w) > 1 for w in p.bad_words_token_ids)


def _prompt_logprobs_entries(chunks: list[PromptLogprobsChunk]) -> list[LogprobsEntry]:
    """One `LogprobsEntry` per prompt position 1.., from the chunks in position order."""
    if not chunks:  # a one-token prompt: nothing predicts anything in it
        return []
    chunks = sorted(chunks, key=lambda c: c[0])
    ids = torch.cat([c[1] for c in chunks]).tolist()
    lps = torch.cat([c[2] for c in chunks]).tolist()
    ranks = torch.cat([c[3] for c in chunks]).tolist()
    return [LogprobsEntry(i, lp, r) for i, lp, r in zip(ids, lps, ranks, strict=True)]


class PendingOutput:
    """A step's sampled tokens, still on the device until `result()` reads them (once)."""

    def __init__(
        self,
        states: list[CachedRequestState],
        result: SamplerOutput | None,
        prompt_logprobs: dict[str, list[PromptLogprobsChunk]] | None = None,
    ) -> None:
        self.states = states
        self.sampler_output = result
        # Requests whose prompt ended this step: their prompt logprobs, read with the tokens.
        self.prompt_logprobs = prompt_logprobs or {}
        self.sampled = result.sampled_token_ids if result is not None else None
        self.row_of = {s.req_id: i for i, s in enumerate(states)}
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def empty(cls) -> PendingOutput:
        return cls([], None)

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        output = ModelRunnerOutput(sampled_token_ids={})
        result = self.sampler_output
        if result is not None:
            token_ids = result.sampled_token_ids.tolist()  # waits for the device
            for state, token in zip(self.states, token_ids, strict=True):
                state.token_ids.append(token)
                state.num_pending -= 1
                output.sampled_token_ids[state.req_id] = token
            if result.logprob_token_ids is not None and result.logprobs is not None:
                ids = result.logprob_token_ids.tolist()
                lps = result.logprobs.tolist()
                ranks = result.sampled_token_ranks.tolist()  # type: ignore[union-attr]
                for i, state in enumerate(self.states):
                    k = state.sampling_params.logprobs
                    if k is not None:
                        output.logprobs[state.req_id] = LogprobsEntry(
                            ids[i][: k + 1], lps[i][: k + 1], ranks[i]
                        )
        for req_id, chunks in self.prompt_logprobs.items():
            output.prompt_logprobs[req_id] = _prompt_logprobs_entries(chunks)
        self._output = output
        return output


def attention_specs(config: ModelConfig) -> list[AttentionSpec]:
    """How each layer of the model attends: its scale, sliding window and soft-capping."""
    windows = config.layer_windows or (None,) * config.num_layers
    return [
        AttentionSpec(config.attention_scale, w, config.attn_logit_softcapping) for w in windows
    ]


def zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool = True
) -> torch.Tensor:
    """A zeroed tensor; on CPU backed by anonymous memory, whose pages the kernel hands out as
    zeros when first touched: a 4 GiB KV cache is ready at once instead of after writing 4 GiB
    of zeros (1.6 s on one core), and takes memory only as blocks are used.

    On CPU the mapping asks for transparent huge pages (`MADV_HUGEPAGE`, what the kernel's
    default `madvise` mode waits for): decode attention reads a request's blocks from all over
    the cache, and with 4 KiB pages nearly every block is a TLB miss. With 2 MiB pages the C
    kernel ran 1.10-1.16x faster (`bench/cpu_attention.py --huge-pages`); the price is that
    memory is taken 2 MiB at a time as blocks are first written. A kernel built without THP
    refuses the advice (EINVAL), and the cache keeps 4 KiB pages."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor holds the mapping (frombuffer keeps its buffer alive); unmapped when freed.
    # Private, not mmap's default shared mapping: shared anonymous memory is shmem, whose first
    # touch cost 5.4 ms per 8 MiB against 3.7 ms here (the price of a fresh block's first write).
    anon = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        with contextlib.suppress(OSError):  # advice only
            anon.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(anon, dtype=torch.uint8).view(dtype).view(shape)


class ModelRunner:
    """Runs the model (one tensor-parallel rank's shard of it) over its paged KV cache.

    Every rank samples from the same gathered logits with the same generators, so every rank
    appends the same tokens to its request states without being told them.
    """

    def __init__(
        self, model_config: ModelConfig, config: RunnerConfig, tp: TensorParallel | None = None
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        self.model = load_model(model_config, config.dtype, config.device, config.max_model_len, tp)
        if self.device.type == "cpu":  # oneDNN with weights packed once, as vLLM's CPU build
            pack_linears(self.model)
        self.num_kv_heads = self.model.layout.num_kv_heads  # this rank's shard of the cache
        self.attn = make_attention_backend(
            config.attention_backend, config.block_size, attention_specs(model_config)
        )
        self.sampler = Sampler()
        # Generators live where the logits are: the sampler draws its noise there.
        self.generator = torch.Generator(device=config.device)
        self.generator.manual_seed(config.seed)
        self.requests: dict[str, CachedRequestState] = {}
        self._pending: PendingOutput | None = None  # the last step whose tokens may be unread
        self._step_tokens: dict[str, int] = {}  # this step's scheduled tokens per request
        self.kv_cache: torch.Tensor | None = None

    # ---- KV cache ------------------------------------------------------------------------

    def device_memory(self) -> tuple[int, int, int] | None:
        """(free, total, held by this process) bytes of the device after loading; None on CPU.
        What this process holds is torch's reservation: the weights and buffers."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total, torch.cuda.memory_reserved(self.device)

    def kv_bytes_per_block(self) -> int:
        c = self.model_config
        elems = c.num_layers * 2 * self.block_size * self.num_kv_heads * c.head_dim
        return elems * torch.empty((), dtype=self.config.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        c = self.model_config
        shape = (num_blocks, c.num_layers, 2, self.block_size, self.num_kv_heads, c.head_dim)
        self.kv_cache = zeroed(shape, self.config.dtype, self.device)
        return self.kv_cache

    # ---- one step ------------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                generator=generator,
                num_computed_tokens=new.num_computed_tokens,
            )
            self._init_processors(state)
            self.requests[new.req_id] = state
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.resumed:
                # Recomputed from num_computed_tokens on: what was computed past it goes.
                state.prompt_logprobs = _truncate_chunks(
                    state.prompt_logprobs, cached.num_computed_tokens
                )
                state.block_ids = list(cached.new_block_ids)
                if cached.all_token_ids is not None:
                    state.token_ids = list(cached.all_token_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and waits for its sampled tokens."""
        return self.execute_model_async(out).result()

    @torch.inference_mode()
    def execute_model_async(self, out: SchedulerOutput) -> PendingOutput:
        """Queues one step on the device and returns without waiting for it.

        With async scheduling the next step is built while this one runs: a decode whose input
        token is still on the device reads it from the previous step's sampled tensor there.
        """
        self._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return PendingOutput.empty()
        assert self.kv_cache is not None, "allocate_kv_cache first"
        scheduled = [self.requests[r] for r in out.num_scheduled_tokens]
        self._step_tokens = out.num_scheduled_tokens
        if self._pending is not None and any(
            s.num_pending and _needs_history(s.sampling_params) for s in scheduled
        ):
            self._pending.result()  # penalties and bad words need every past token on the host
        bs = self.block_size
        num_reqs = len(scheduled)
        total = out.total_num_scheduled_tokens
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slot_mapping = np.empty(total, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_reqs, dtype=np.int32)
        max_blocks = max(len(s.block_ids) for s in scheduled)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        sample_rows: list[int] = []  # batch rows whose chunk reaches the end: they sample
        from_device: list[tuple[int, int]] = []  # (input index, row of the previous step)
        pos = 0
        for row, (state, n) in enumerate(
            zip(scheduled, out.num_scheduled_tokens.values(), strict=True)
        ):
            known = len(state.token_ids)
            start = state.num_computed_tokens
            end = start + n
            if end > known:  # the last input token is still being sampled
                if state.num_pending != 1 or end != known + 1 or self._pending is None:
                    raise RuntimeError(f"request {state.req_id} is ahead of its tokens")
                from_device.append((pos + n - 1, self._pending.row_of[state.req_id]))
                input_ids[pos : pos + n - 1] = state.token_ids[start:known]
            else:
                input_ids[pos : pos + n] = state.token_ids[start:end]
            p = np.arange(start, end)
            positions[pos : pos + n] = p
            table = np.asarray(state.block_ids, dtype=np.int64)
            block_tables[row, : len(table)] = table
            slot_mapping[pos : pos + n] = table[p // bs] * bs + p % bs
            pos += n
            query_start_loc[row + 1] = pos
            seq_lens[row] = end
            if end >= known + state.num_pending:
                sample_rows.append(row)

        h2d = self._to_device
        input_ids_t = h2d(input_ids)
        if from_device:
            assert self._pending is not None
            idx, prev_rows = (np.asarray(x, dtype=np.int64) for x in zip(*from_device, strict=True))
            assert self._pending.sampled is not None
            input_ids_t[h2d(idx)] = self._pending.sampled[h2d(prev_rows)]
        meta = AttentionMetadata(
            slot_mapping=h2d(slot_mapping),
            query_start_loc=h2d(query_start_loc),
            seq_lens=h2d(seq_lens),
            block_tables=h2d(block_tables),
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens,
            block_tables_np=block_tables,
        )
        hidden = self.model(input_ids_t, h2d(positions), self.kv_cache, self.attn, meta)
        for row, state in enumerate(scheduled):
            if state.sampling_params.prompt_logprobs is not None and state.in_prompt:
                self._compute_prompt_logprobs(state, hidden, int(query_start_loc[row]))
        if not sample_rows:
            return PendingOutput.empty()
        last_token_idx = h2d((query_start_loc[1:][sample_rows] - 1).astype(np.int64))
        logits = self.model.compute_logits(hidden[last_token_idx])
        sampled = [scheduled[r] for r in sample_rows]
        metadata = self._sampling_metadata(sampled)
        metadata.token_bitmask, metadata.token_bitmask_rows = self._token_bitmask(out, sampled)
        result = self.sampler(logits, metadata)
        prompt_logprobs = {}
        for state in sampled:
            if state.sampling_params.prompt_logprobs is not None and state.in_prompt:
                chunks, state.prompt_logprobs = state.prompt_logprobs, []
                if _covers_prompt(chunks, state.num_prompt_tokens):
                    prompt_logprobs[state.req_id] = chunks
                else:  # never misaligned: positions 1.. or nothing
                    logger.warning(
                        "request %s: prompt logprobs not sent, part of its prompt came with "
                        "its KV (a prefix-cache hit or a KV pull) and was never computed here",
                        state.req_id,
                    )
            state.num_pending += 1
        self._pending = PendingOutput(sampled, result, prompt_logprobs)
        return self._pending

    def _token_bitmask(
        self, out: SchedulerOutput, sampled: list[CachedRequestState]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The grammar's mask in this step's sample-row order, and the rows it constrains: the
        scheduler's rows follow its own list of constrained requests; the rows of
        unconstrained requests allow everything (and are left alone by the sampler)."""
        if out.grammar_bitmask is None:
            return None, None
        rows = {req_id: i for i, req_id in enumerate(out.structured_output_request_ids)}
        mask = np.full((len(sampled), out.grammar_bitmask.shape[1]), -1, dtype=np.int32)
        constrained = []
        for i, state in enumerate(sampled):
            row = rows.get(state.req_id)
            if row is not None:
                mask[i] = out.grammar_bitmask[row]
                constrained.append(i)
        return self._to_device(mask), self._to_device(np.asarray(constrained, dtype=np.int64))

    def _compute_prompt_logprobs(
        self, state: CachedRequestState, hidden: torch.Tensor, offset: int
    ) -> None:
        """Logprobs of the prompt tokens this step's chunk predicts, kept on the device.

        The hidden state at position j predicts the token at j + 1, so a chunk [start, end)
        yields prompt positions start + 1 .. min(end, n - 1) (the last prompt position predicts
        the first output token, which is the sampled logprobs' business).
        """
        start = state.num_computed_tokens
        stop = min(start + self._step_tokens[state.req_id], state.num_prompt_tokens - 1)
        k = state.sampling_params.prompt_logprobs
        assert k is not None
        for lo in range(start, stop, _PROMPT_LOGPROBS_ROWS):
            hi = min(lo + _PROMPT_LOGPROBS_ROWS, stop)
            logits = self.model.compute_logits(hidden[offset + lo - start : offset + hi - start])
            targets = self._to_device(np.asarray(state.token_ids[lo + 1 : hi + 1], np.int64))
            ids, lps, ranks = gather_logprobs(torch.log_softmax(logits, dim=-1), targets, k)
            state.prompt_logprobs.append((lo + 1, ids, lps, ranks))

    def _init_processors(self, state: CachedRequestState) -> None:
        """Turn a new request's logit_bias, allowed_token_ids and bad words into the forms the
        sampler takes, once; ids past the logits' width (the edge checks them) are dropped."""
        p = state.sampling_params
        vocab = self.model_config.vocab_size
        if p.logit_bias:
            items = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
            state.logit_bias = (
                np.asarray([t for t, _ in items], np.int64),
                np.asarray([b for _, b in items], np.float32),
            )
        if p.allowed_token_ids is not None:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[[t for t in p.allowed_token_ids if t < vocab]] = True
            state.allowed_mask = mask.to(self.device)
        for word in p.bad_words_token_ids:
            if word[-1] >= vocab:
                continue
            if len(word) == 1:
                state.banned.append(word[0])
            else:
                state.bad_words.append(word)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array to device without blocking: a copy from pageable memory would first wait
        for every queued kernel, which is exactly the overlap async scheduling is after."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        greedy = all(p.greedy for p in params)
        needs_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        max_logprobs = max(needs_logprobs) if needs_logprobs else None
        penalties = any(_uses_penalties(p) for p in params)
        min_block: dict[int, list[int]] = {}
        eos = self.model_config.eos_token_ids
        for row, (s, p) in enumerate(zip(states, params, strict=True)):
            num_output = len(s.token_ids) + s.num_pending - s.num_prompt_tokens
            if p.min_tokens and num_output < p.min_tokens:
                # EOS too under ignore_eos, as vLLM (`all_stop_token_ids` always holds it):
                # min_tokens forbids it, ignore_eos keeps it from ending the request after.
                min_block[row] = list(p.stop_token_ids) + list(eos)

        def column(values: list[float], skip: float, dtype: type) -> torch.Tensor | None:
            if all(v == skip for v in values):
                return None
            return self._to_device(np.asarray(values, dtype=dtype))

        def rows_cols(pairs: list[tuple[int, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
            rows = np.concatenate([np.full(len(c), r, np.int64) for r, c in pairs])
            return self._to_device(rows), self._to_device(np.concatenate([c for _, c in pairs]))

        logit_bias = None
        biased = [(r, s.logit_bias) for r, s in enumerate(states) if s.logit_bias is not None]
        if biased:
            rows, cols = rows_cols([(r, b[0]) for r, b in biased])
            logit_bias = (rows, cols, self._to_device(np.concatenate([b[1] for _, b in biased])))
        allowed = None
        masks = {r: s.allowed_mask for r, s in enumerate(states) if s.allowed_mask is not None}
        if masks:
            restricted = self._to_device(np.asarray(list(masks), np.int64))
            allowed = (restricted, torch.stack(list(masks.values())))
        bad_words = None
        blocked = [
            (r, self._bad_word_block(s)) for r, s in enumerate(states) if s.banned or s.bad_words
        ]
        blocked = [(r, ids) for r, ids in blocked if len(ids)]
        if blocked:
            bad_words = rows_cols(blocked)

        return SamplingMetadata(
            temperature=self._to_device(np.asarray([p.temperature for p in params], np.float32)),
            # Processors run first either way; all-greedy rows then need only the argmax.
            all_greedy=greedy,
            top_k=column([p.top_k for p in params], 0, np.int64),
            top_p=column([p.top_p for p in params], 1.0, np.float32),
            min_p=column([p.min_p for p in params], 0.0, np.float32),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            presence_penalty=column([p.presence_penalty for p in params], 0.0, np.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], 0.0, np.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], 1.0, np.float32),
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states]
            if penalties
            else [],
            output_token_ids=[s.output_token_ids for s in states] if penalties else [],
            min_tokens_block=min_block,
            max_num_logprobs=max_logprobs,
            generator=self.generator,
            allowed_token_ids=allowed,
            bad_words_block=bad_words,
            logit_bias=logit_bias,
        )

    @staticmethod
    def _bad_word_block(state: CachedRequestState) -> np.ndarray:
        """Token ids a request's bad words forbid now: each one-token word, and each longer
        word's last token when the output so far ends with the word's other tokens (vLLM's
        rule, vllm/v1/sample/ops/bad_words.py; only the output counts, not the prompt)."""
        ids = list(state.banned)
        output = state.output_token_ids
        for word in state.bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                ids.append(word[-1])
        return np.asarray(ids, np.int64)


def _covers_prompt(chunks: list[PromptLogprobsChunk], num_prompt_tokens: int) -> bool:
    """Whether the chunks hold exactly prompt positions 1 .. n-1, each once, in some order."""
    expected = 1
    for first, ids, _, _ in sorted(chunks, key=lambda c: c[0]):
        if first != expected:
            return False
        expected += len(ids)
    return expected == max(num_prompt_tokens, 1)


def _truncate_chunks(
    chunks: list[PromptLogprobsChunk], num_computed: int
) -> list[PromptLogprobsChunk]:
    """Keep the prompt logprobs of positions <= num_computed: those are not computed again.

    Position p is predicted by the hidden state at p - 1, which a resumed request recomputes
    only if p - 1 >= num_computed.
    """
    kept = []
    for first, ids, lps, ranks in chunks:
        n = min(len(ids), num_computed + 1 - first)
        if n > 0:
            kept.append((first, ids[:n], lps[:n], ranks[:n]))
    return kept
