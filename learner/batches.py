"""From replay-buffer examples to padded token batches with an assistant-token mask.

A conversation is rendered with the tokenizer's chat template; the prompt part (everything
up to and including the assistant header `<|im_start|>assistant\n`) and the completion are
tokenized separately and concatenated, exactly as the serving engine sees a prompt followed
by generated tokens. Only completion tokens carry loss. The template is the tool-aware one
(`clora.infra.chat_template`): `tools` and assistant tool calls render exactly as vLLM
renders them for serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clora.ingest.schemas import Message, PreferencePair, RLSample, SFTExample


@dataclass(frozen=True)
class TokenBatch:
    """Right-padded token batch.

    Example, two sequences "P P C C" and "P C C C" (P prompt, C completion), pad 0:
      input_ids      [[p, p, c, c], [p, c, c, c]]
      attention_mask [[1, 1, 1, 1], [1, 1, 1, 1]]
      loss_mask      [[0, 1, 1], [1, 1, 1]]   # (B, T-1): position t scores input_ids[:, t+1]
    `behaviour_logprobs` (B, T-1), aligned like loss_mask, only for RL batches.
    """

    input_ids: torch.Tensor       # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    loss_mask: torch.Tensor       # (B, T-1) float32
    behaviour_logprobs: torch.Tensor | None = None  # (B, T-1) float32

    @property
    def num_target_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device) -> "TokenBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return TokenBatch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                          move(self.behaviour_logprobs))


@dataclass(frozen=True)
class Sequence:
    """One tokenized prompt + completion (completion_logprobs align with completion_ids)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float] | None = None


def message_dict(m: Message) -> dict:
    """The OpenAI-shaped dict the chat template renders (as vLLM passes it)."""
    return m.model_dump(exclude_none=True)


class ChatEncoder:
    """Tokenizes examples with a tokenizer's chat template, truncating to `max_len` tokens
    (the prompt loses its oldest tokens first; the completion is cut only if it alone is too long)."""

    def __init__(self, tokenizer, max_len: int = 512):
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer has no chat template")
        self.tok = tokenizer
        self.max_len = max_len

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def encode(self, messages: list[Message], completion: Message, tools: list[dict] | None = None) -> Sequence:
        msgs = [message_dict(m) for m in messages]
        prompt = self.tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        full = self.tok.apply_chat_template(msgs + [message_dict(completion)], tools=tools, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError("chat template does not render the prompt as a prefix of the conversation")
        completion_text = full[len(prompt):].rstrip("\n")  # ends with the end-of-turn token
        return Sequence(self._ids(prompt), self._ids(completion_text))

    def encode_rl(self, s: RLSample) -> Sequence:
        if s.prompt_token_ids and s.completion_token_ids:
            return Sequence(list(s.prompt_token_ids), list(s.completion_token_ids),
                            list(s.behaviour_logprobs) if s.behaviour_logprobs else None)
        seq = self.encode(s.messages, s.response, s.tools)
        return seq  # no serving-time token ids: behaviour = current policy (on-policy)

    def collate(self, seqs: list[Sequence]) -> TokenBatch:
        rows, masks, blps, any_blp = [], [], [], any(s.completion_logprobs is not None for s in seqs)
        for s in seqs:
            comp, lps = s.completion_ids[: self.max_len - 1], s.completion_logprobs
            prompt = s.prompt_ids[-(self.max_len - len(comp)):] if len(s.prompt_ids) + len(comp) > self.max_len else s.prompt_ids
            if not prompt or not comp:
                raise ValueError(f"sequence has an empty prompt or completion ({len(prompt)}, {len(comp)} tokens)")
            rows.append(prompt + comp)
            masks.append([0.0] * (len(prompt) - 1) + [1.0] * len(comp))
            blps.append([0.0] * (len(prompt) - 1) + (list(lps[: len(comp)]) if lps else [0.0] * len(comp)))
        width = max(len(r) for r in rows)
        pad = self.tok.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        blp = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        for i, (r, m, b) in enumerate(zip(rows, masks, blps)):
            ids[i, : len(r)] = torch.tensor(r)
            att[i, : len(r)] = 1
            mask[i, : len(m)] = torch.tensor(m)
            blp[i, : len(b)] = torch.tensor(b)
        return TokenBatch(ids, att, mask, blp if any_blp else None)

    def sft(self, examples: list[SFTExample]) -> TokenBatch:
        return self.collate([self.encode(e.messages, e.target, e.tools) for e in examples])

    def preference(self, pairs: list[PreferencePair]) -> tuple[TokenBatch, TokenBatch]:
        """(chosen, rejected), row i of each from pair i."""
        return (self.collate([self.encode(p.messages, p.chosen, p.tools) for p in pairs]),
                self.collate([self.encode(p.messages, p.rejected, p.tools) for p in pairs]))

    def rl(self, samples: list[RLSample]) -> TokenBatch:
        return self.collate([self.encode_rl(s) for s in samples])
