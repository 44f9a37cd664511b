"""From replay-buffer examples to padded token batches with an assistant-token mask.

A conversation is rendered with the tokenizer's chat template; the prompt part (everything
up to and including the assistant header `<|im_start|>assistant\n`) and the completion are
tokenized separately and concatenated, exactly as the serving engine sees a prompt followed
by generated tokens. Only completion tokens carry loss. The template is the tool-aware one
(`clora.learner.chat_template`): `tools` and assistant tool calls render exactly as vLLM
renders them for serving.

RL batches pack an episode's turns. An agent's turn k+1 is served on a prompt that starts with
turn k's prompt and completion tokens (the conversation so far), so turn k's whole sequence
is a prefix of turn k+1's. `pack_turns` finds such prefixes in a batch, exactly, token for
token, and gives them one row: the longest sequence, with every packed sample's completion
tokens carrying that sample's behaviour logprobs, advantage and weight (1 / its completion
length). The causal model scores a prefix's tokens the same in the longer row, so the loss is
the one-row-per-sample loss, on the tokens of the longest turn instead of all turns'.
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
    RL batches (`ChatEncoder.rl`) also carry, aligned like loss_mask: `behaviour_logprobs`
    (when served; None when no sample has them, NaN on the target tokens of a sample without
    them beside samples with them: see `losses.behaviour_or_current`), `advantages` (each
    target token's sample's advantage) and `weights` (1 / its sample's target tokens; see
    `losses.clipped_surrogate`). A row may hold several samples (packed turns): `samples`
    counts them.
    """

    input_ids: torch.Tensor       # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    loss_mask: torch.Tensor       # (B, T-1) float32
    behaviour_logprobs: torch.Tensor | None = None  # (B, T-1) float32
    advantages: torch.Tensor | None = None          # (B, T-1) float32, RL
    weights: torch.Tensor | None = None             # (B, T-1) float32, RL
    samples: int | None = None                      # RL: samples in the rows (>= B)

    @property
    def num_target_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device) -> "TokenBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return TokenBatch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                          move(self.behaviour_logprobs), move(self.advantages), move(self.weights), self.samples)


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

    def __init__(self, tokenizer, max_len: int = 512, pack_turns: bool = True):
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer has no chat template")
        self.tok = tokenizer
        self.max_len = max_len
        self.pack_turns = pack_turns
        """RL batches: an episode's turns share a row (`pack_turns`); False: one row per sample."""

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

    def collate(self, seqs: list[Sequence], advantages: torch.Tensor | None = None,
                rows: list[list[int]] | None = None) -> TokenBatch:
        """Right-padded rows, one per sequence, or with `rows` (`pack_turns`) one per group of
        sequence indices, the last of each group its longest: the row is that sequence, and
        every member's completion tokens get its mask, behaviour logprobs, advantage and weight.
        With `advantages` (one per sequence) the batch is an RL batch (`advantages`, `weights`)."""
        rows = rows if rows is not None else [[i] for i in range(len(seqs))]
        any_blp = any(s.completion_logprobs is not None for s in seqs)
        width = 0
        plans = []
        for group in rows:
            host = seqs[group[-1]]
            comp = host.completion_ids[: self.max_len - 1]
            keep = self.max_len - len(comp)  # prompt tokens that fit (the oldest are cut)
            prompt = host.prompt_ids[-keep:] if len(host.prompt_ids) + len(comp) > self.max_len else host.prompt_ids
            if not prompt or not comp:
                raise ValueError(f"sequence has an empty prompt or completion ({len(prompt)}, {len(comp)} tokens)")
            if len(group) > 1 and len(prompt) != len(host.prompt_ids):
                raise ValueError(f"a packed row of {len(group)} samples is longer than {self.max_len} tokens")
            plans.append((group, prompt + comp, len(prompt) - len(host.prompt_ids)))
            width = max(width, len(prompt) + len(comp))
        b = len(rows)
        ids = torch.full((b, width), self.tok.pad_token_id, dtype=torch.long)
        att = torch.zeros((b, width), dtype=torch.long)
        mask, blp, adv, weight = (torch.zeros((b, width - 1), dtype=torch.float32) for _ in range(4))
        for r, (group, row, shift) in enumerate(plans):
            ids[r, : len(row)] = torch.tensor(row)
            att[r, : len(row)] = 1
            for i in group:
                s = seqs[i]
                start = len(s.prompt_ids) + shift - 1  # position t scores token t + 1
                n = min(len(s.completion_ids), len(row) - 1 - start)
                mask[r, start:start + n] = 1.0
                weight[r, start:start + n] = 1.0 / n
                if s.completion_logprobs:
                    blp[r, start:start + n] = torch.tensor(s.completion_logprobs[:n], dtype=torch.float32)
                else:  # none served: the current policy's stand in (`losses.behaviour_or_current`)
                    blp[r, start:start + n] = float("nan")
                if advantages is not None:
                    adv[r, start:start + n] = float(advantages[i])
        if advantages is None:
            return TokenBatch(ids, att, mask, blp if any_blp else None)
        return TokenBatch(ids, att, mask, blp if any_blp else None, adv, weight, len(seqs))

    def sft(self, examples: list[SFTExample]) -> TokenBatch:
        return self.collate([self.encode(e.messages, e.target, e.tools) for e in examples])

    def preference(self, pairs: list[PreferencePair]) -> tuple[TokenBatch, TokenBatch]:
        """(chosen, rejected), row i of each from pair i."""
        return (self.collate([self.encode(p.messages, p.chosen, p.tools) for p in pairs]),
                self.collate([self.encode(p.messages, p.rejected, p.tools) for p in pairs]))

    def rl(self, samples: list[RLSample], advantages: torch.Tensor | None = None) -> TokenBatch:
        """RL batch: `advantages` (one per sample; zeros when None) on every target token, an
        episode's turns packed into one row (`pack_turns`) when the encoder packs."""
        seqs = [self.encode_rl(s) for s in samples]
        adv = advantages if advantages is not None else torch.zeros(len(samples))
        if len(adv) != len(seqs):
            raise ValueError(f"rl batch: {len(adv)} advantages for {len(seqs)} samples")
        return self.collate(seqs, adv, pack_turns(seqs, self.max_len) if self.pack_turns else None)


def micro_batches(encoder: ChatEncoder, examples: list, size: int) -> list[list[int]]:
    """The micro-batches a step trains `examples` in, as lists of their indices: `size`
    examples each, in order; for RL `size` rows each, an episode's turns packed into one row
    over the whole batch (`pack_turns`), so a packed row is never cut between micro-batches.
    Any split gives the same step: each micro-batch's loss is scaled by its share of samples.
    Example: RL, turns [t0, t1] of one episode and one single-turn u, size 1 -> [[0, 1], [2]]."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    if not encoder.pack_turns or not examples or any(getattr(e, "kind", None) != "rl" for e in examples):
        return [list(range(i, min(i + size, len(examples)))) for i in range(0, len(examples), size)]
    rows = pack_turns([encoder.encode_rl(e) for e in examples], encoder.max_len)
    return [[i for row in rows[k:k + size] for i in row] for k in range(0, len(rows), size)]


def pack_turns(seqs: list[Sequence], max_len: int) -> list[list[int]]:
    """Groups of sequence indices that can share a row (see the module doc): a sequence joins
    the row of a longer one when its prompt + completion tokens are exactly the start of that
    one's prompt, both have served logprobs or neither has, the row fits in `max_len` tokens, and
    no sample already in the row scores the same positions (a group's identical first turns
    each need their own). Each group lists its members shortest first, the row's sequence last;
    groups come in the order of their row's sequence. [[0], [1]] when nothing packs.
    Example: a two-turn episode, turn 0 = P0 C0 and turn 1 = (P0 C0 T) C1 -> [[0, 1]]."""
    full = [s.prompt_ids + s.completion_ids for s in seqs]
    hosts: dict[int, list[tuple[int, int]]] = {}  # row sequence -> its members' target spans
    members: dict[int, list[int]] = {}
    for i in sorted(range(len(seqs)), key=lambda i: (-len(full[i]), i)):
        s, span = seqs[i], (len(seqs[i].prompt_ids), len(full[i]))
        home = next((h for h, spans in hosts.items()
                     if len(full[i]) <= len(seqs[h].prompt_ids) and len(full[h]) <= max_len
                     and (s.completion_logprobs is None) == (seqs[h].completion_logprobs is None)
                     and full[h][: len(full[i])] == full[i]
                     and all(span[1] <= a or b <= span[0] for a, b in spans)), None)
        if home is None:
            hosts[i], members[i] = [span], [i]
        else:
            hosts[home].append(span)
            members[home].append(i)
    return [sorted(members[h], key=lambda i: len(full[i])) for h in sorted(hosts)]
