"""The persistent input batch: per-row host arrays that the schedule's diffs patch in place.

Every running request owns a row (also its penalty-state row on the device) of numpy arrays:
page table, pages filled, prompt length, prompt-logprob flag, where its last sample sits in the
previous program's sampled ids, and its sampling columns (`SamplingRows`). Nothing is rebuilt
per step from Python objects.

1. `join(s)`: a request that (re)joins the batch (`ScheduledRequest.is_new`) gets a row filled
   from scratch (its whole page table, sampling parameters, seed).
2. `extend(row, s)`: a running request's newly allocated pages are appended to its table.
3. `release(ids, finished=...)`: rows of finished / preempted requests are freed; a preempted
   request keeps its seed (it resamples identically when it resumes).

NOTE: row `max_num_seqs` is a spare that padding rows point at (never owned).
"""

from __future__ import annotations

import random

import numpy as np

from jaxinfer.engine.types import ScheduledRequest
from jaxinfer.sampling import SamplingRows


class InputBatch:
    """Rows of the running requests (see the module docstring)."""

    def __init__(self, max_num_seqs: int, pages_per_seq: int, enable_lora: bool = False) -> None:
        self.max_num_seqs, self.pages_per_seq = max_num_seqs, pages_per_seq
        rows = max_num_seqs + 1
        self.rows: dict[str, int] = {}  # request id -> its row
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.page_table = np.zeros((rows, pages_per_seq), np.int32)
        self.num_pages = np.zeros(rows, np.int32)  # filled entries of each table
        self.prompt_len = np.zeros(rows, np.int32)
        self.wants_prompt_lps = np.zeros(rows, bool)
        self.last_sample = np.full(rows, -1, np.int32)  # row of the previous sampled ids; -1: none
        self.sampling = SamplingRows(max_num_seqs)
        self.enable_lora = enable_lora  # steps carry each token's LoRA slot
        self.lora_slot = np.zeros(rows, np.int32)  # the row's pinned LoRA slot (0: none)
        self.seeds: dict[str, int] = {}  # NOTE: kept across preemption (resamples identically)
        self._rng = random.Random()

    def release(self, request_ids: list[str], *, finished: bool) -> None:
        """Frees rows; a preempted request keeps its seed so it resamples identically."""
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.free_rows.append(row)
                self.last_sample[row] = -1
            if finished:
                self.seeds.pop(rid, None)

    def join(self, s: ScheduledRequest) -> int:
        """Fills a row for a request that (re)joins the batch; returns the row."""
        req = s.request
        rid, sp = req.request_id, req.sampling
        row = self.rows.get(rid)
        if row is None:
            if not self.free_rows:
                raise RuntimeError(
                    f"request {rid!r}: no free row (more than max_num_seqs="
                    f"{self.max_num_seqs} running requests)"
                )
            row = self.rows[rid] = self.free_rows.pop()
        pages, old = len(s.new_page_ids), int(self.num_pages[row])
        if pages > self.pages_per_seq:
            raise ValueError(
                f"request {rid!r}: page table of {pages} pages exceeds "
                f"max_model_len / page_size = {self.pages_per_seq}"
            )
        self.page_table[row, :pages] = s.new_page_ids
        self.page_table[row, pages:old] = 0
        self.num_pages[row] = pages
        self.prompt_len[row] = req.num_prompt_tokens
        self.wants_prompt_lps[row] = sp.prompt_logprobs is not None
        self.last_sample[row] = -1
        self.lora_slot[row] = req.lora_slot
        seed = self.seeds.get(rid)
        if seed is None:
            seed = self.seeds[rid] = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        suppress: list[int] = []
        if sp.min_tokens:  # stop ids (and EOS) are forbidden until min_tokens outputs exist
            suppress = list(sp.stop_token_ids or []) + (
                [] if sp.ignore_eos else list(req.eos_token_ids)
            )
        self.sampling.set(row, sp, seed, suppress, req.num_prompt_tokens + sp.min_tokens)
        return row

    def extend(self, row: int, s: ScheduledRequest) -> None:
        """Appends a running request's newly allocated pages to its row's page table."""
        old = int(self.num_pages[row])
        new = old + len(s.new_page_ids)
        if new > self.pages_per_seq:
            raise ValueError(
                f"request {s.request.request_id!r}: page table of {new} pages exceeds "
                f"max_model_len / page_size = {self.pages_per_seq}"
            )
        self.page_table[row, old:new] = s.new_page_ids
        self.num_pages[row] = new
