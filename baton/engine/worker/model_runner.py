"""Model runner: one forward pass over a mixed batch per `SchedulerOutput`, then sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.models.config import ModelConfig
from baton.engine.models.loader import load_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler.output import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from baton.engine.worker.attention import AttentionMetadata, make_attention_backend
from baton.engine.worker.sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)


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

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: RunnerConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        self.model = load_model(model_config, config.dtype, config.device, config.max_model_len)
        self.attn = make_attention_backend(
            config.attention_backend, config.block_size, model_config.head_dim**-0.5
        )
        self.sampler = Sampler()
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(config.seed)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache: torch.Tensor | None = None

    # ---- KV cache ------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        c = self.model_config
        elems = c.num_layers * 2 * self.block_size * c.num_kv_heads * c.head_dim
        return elems * torch.empty((), dtype=self.config.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        c = self.model_config
        shape = (num_blocks, c.num_layers, 2, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.config.dtype, device=self.device)
        return self.kv_cache

    # ---- one step ------------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                generator=generator,
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
                if cached.all_token_ids is not None:
                    state.token_ids = list(cached.all_token_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        assert self.kv_cache is not None, "allocate_kv_cache first"
        bs = self.block_size
        num_reqs = len(out.num_scheduled_tokens)
        total = out.total_num_scheduled_tokens
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slot_mapping = np.empty(total, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_reqs, dtype=np.int32)
        max_blocks = max(len(self.requests[r].block_ids) for r in out.num_scheduled_tokens)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        sample_rows: list[int] = []  # batch rows whose chunk reaches the end: they sample
        states: list[CachedRequestState] = []
        pos = 0
        for row, (req_id, n) in enumerate(out.num_scheduled_tokens.items()):
            state = self.requests[req_id]
            states.append(state)
            seq_len = len(state.token_ids)
            start = state.num_computed_tokens
            end = start + n
            input_ids[pos : pos + n] = state.token_ids[start:end]
            p = np.arange(start, end)
            positions[pos : pos + n] = p
            table = np.asarray(state.block_ids, dtype=np.int64)
            block_tables[row, : len(table)] = table
            slot_mapping[pos : pos + n] = table[p // bs] * bs + p % bs
            pos += n
            query_start_loc[row + 1] = pos
            seq_lens[row] = end
            if end >= seq_len:
                sample_rows.append(row)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens,
            block_tables_np=block_tables,
        )
        hidden = self.model(
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            self.kv_cache,
            self.attn,
            meta,
        )
        if not sample_rows:
            return ModelRunnerOutput(sampled_token_ids={})
        last_token_idx = torch.from_numpy(query_start_loc[1:][sample_rows] - 1).to(dev).long()
        logits = self.model.compute_logits(hidden[last_token_idx])
        sampled = [states[r] for r in sample_rows]
        result = self.sampler(logits, self._sampling_metadata(sampled))
        token_ids = result.sampled_token_ids.tolist()
        output = ModelRunnerOutput(sampled_token_ids={})
        for state, token in zip(sampled, token_ids, strict=True):
            state.token_ids.append(token)
            output.sampled_token_ids[state.req_id] = token
        if result.logprob_token_ids is not None and result.logprobs is not None:
            ids = result.logprob_token_ids.tolist()
            lps = result.logprobs.tolist()
            ranks = result.sampled_token_ranks.tolist()  # type: ignore[union-attr]
            for i, state in enumerate(sampled):
                k = state.sampling_params.logprobs
                if k is not None:
                    output.logprobs[state.req_id] = LogprobsEntry(
                        ids[i][: k + 1], lps[i][: k + 1], ranks[i]
                    )
        return output

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        dev = self.device
        greedy = all(p.greedy for p in params)
        needs_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        max_logprobs = max(needs_logprobs) if needs_logprobs else None
        penalties = any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params
        )
        min_block: dict[int, list[int]] = {}
        eos = self.model_config.eos_token_ids
        for row, (s, p) in enumerate(zip(states, params, strict=True)):
            if p.min_tokens and len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
                min_block[row] = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))

        def column(values: list[float], skip: float, dtype: torch.dtype) -> torch.Tensor | None:
            if all(v == skip for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=dev)

        return SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], device=dev),
            all_greedy=greedy and not penalties and not min_block,
            top_k=column([p.top_k for p in params], 0, torch.int64),
            top_p=column([p.top_p for p in params], 1.0, torch.float32),
            min_p=column([p.min_p for p in params], 0.0, torch.float32),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            presence_penalty=column([p.presence_penalty for p in params], 0.0, torch.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], 0.0, torch.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], 1.0, torch.float32),
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states]
            if penalties
            else [],
            output_token_ids=[s.output_token_ids for s in states] if penalties else [],
            min_tokens_block=min_block,
            max_num_logprobs=max_logprobs,
            generator=self.generator,
        )
