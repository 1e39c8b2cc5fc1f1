"""Conversation: a multi-turn chat over one Session that prefills only each turn's new tokens.

The session's cache holds the tokens of the conversation so far (``Conversation.tokens``, as many as
``session.position``). A turn renders the whole conversation with the chat template (plus the generation
prompt) and encodes it; what the cache already holds is its longest common prefix with that encoding, so
the session rewinds to that prefix (usually by nothing: chat templates append, but an answer re-encoded
may split into other tokens than were generated) and prefills only the rest. The cache therefore always
holds exactly the templated conversation's tokens — compared token by token every turn, not assumed.

Where a cache cannot rewind that far (a sliding-window ring past its window, see ``KindOps.max_rewind``)
the turn resets the session and prefills the whole conversation instead (``TurnStats.reprefilled``).

    conv = Conversation(session, tokenizer, template=..., bos_id=..., eos_ids=...)
    with conv.ask("hello", max_new_tokens=64) as turn:   # leaving the block records the answer
        for chunk in turn:                               # (also when interrupted: the text so far)
            print(chunk.text, end="")
    conv.undo(); conv.reset(); conv.save(path); conv.load(path)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace._errors import CacheOverflowError, UsageError
from kvtrace.runtime.generate import Chunk, Generation, GenerationStats, Sampling, stream
from kvtrace.runtime.grammar import Grammar
from kvtrace.runtime.prefix import common_prefix
from kvtrace.runtime.session import Session, Snapshot

__all__ = ["Conversation", "Turn", "TurnStats"]

SAVE_FORMAT = "kvtrace-chat"  # metadata key of a saved conversation (a .safetensors file)
SAVE_VERSION = 1


@dataclass(frozen=True)
class TurnStats:
    """What one turn cost: ``conversation_tokens`` templated in all, of which ``reused`` were already in
    the cache and ``prefilled`` ran now (``rewound``: cache tokens dropped first, where the re-encoded
    conversation diverged from them); ``reprefilled``: the cache could not rewind, so it was reset."""

    conversation_tokens: int
    reused: int
    prefilled: int
    rewound: int
    reprefilled: bool
    generation: GenerationStats

    def line(self) -> str:
        how = "re-prefilled after a reset" if self.reprefilled else f"{self.reused} reused from the cache"
        return (f"turn: prefilled {self.prefilled} new tokens ({how}, {self.rewound} rewound); "
                f"{self.generation.line()}")

    def to_dict(self) -> dict[str, Any]:
        return {"conversation_tokens": self.conversation_tokens, "reused": self.reused,
                "prefilled": self.prefilled, "rewound": self.rewound, "reprefilled": self.reprefilled,
                **self.generation.to_dict()}


class Turn:
    """One answer being generated: iterate its chunks inside ``with``; leaving the block (exhausted,
    broken out of, or interrupted) records the assistant message with the text generated so far."""

    def __init__(self, conv: Conversation, gen: Generation, prompt: list[int], stats: dict[str, Any]):
        self._conv, self._gen, self._prompt, self._stats = conv, gen, prompt, stats
        self.stats: TurnStats | None = None  # set when recorded
        self.text = ""

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self._gen)

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Record the answer (idempotent)."""
        if self.stats is not None:
            return
        res = self._gen.result
        self.text = self._conv._decode(res.tokens)
        self.stats = TurnStats(generation=res.stats, **self._stats)
        self._conv._record(self._prompt, res.tokens, self.text)
        self._conv.last = self.stats


class Conversation:
    """A chat over one ``Session`` (batch 1): messages, and the tokens its cache holds.

    ``tokenizer``: a ``tokenizers.Tokenizer``; ``template``: the artifact's chat template (jinja2, as
    transformers renders it); ``bos_id``/``eos_ids``: the manifest's; ``system``: an optional system message.
    """

    def __init__(self, session: Session, tokenizer: Any, *, template: str, bos_id: int | None,
                 eos_ids: Sequence[int], system: str | None = None):
        if template is None:
            raise UsageError("a chat needs the model's chat template, and this artifact has none")
        if session.spec.batch_size != 1:
            raise UsageError(f"a chat runs one conversation (batch 1); the session's batch is {session.spec.batch_size}")
        self.session, self.tokenizer, self.template = session, tokenizer, template
        self.bos_id, self.eos_ids = bos_id, tuple(eos_ids)
        self._system = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict[str, str]] = list(self._system)
        self.tokens: list[int] = []  # what the cache holds: len(tokens) == session.position
        self._turn_starts: list[int] = []  # len(tokens) before each turn's prefill, for undo
        self.last: TurnStats | None = None
        session.reset()

    # --- encoding -------------------------------------------------------------------------------------
    def encode(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        """The token ids of ``messages`` rendered by the chat template (special tokens as the template places them)."""
        from kvtrace.sources.chat import apply_chat_template

        name = lambda i: self.tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
        text = apply_chat_template(self.template, messages, bos_token=name(self.bos_id),
                                   eos_token=name(self.eos_ids[0] if self.eos_ids else None),
                                   add_generation_prompt=generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # --- turns ----------------------------------------------------------------------------------------
    def ask(self, text: str, *, max_new_tokens: int = 256, sampling: Sampling | None = None,
            speculate: int = 0, grammar: Grammar | None = None) -> Turn:
        """Start the answer to the user message ``text``: the session now holds the whole templated
        conversation (only its new tokens prefilled on the first chunk); iterate the returned Turn.
        ``speculate=k``: prompt-lookup speculative decoding, drafting from the whole conversation
        (``runtime.speculate``; an artifact exported with ``prefill_logits="all"``). ``grammar``: structured output
        for this answer (``runtime.grammar``; ``artifact.grammar(constraint)``)."""
        if not isinstance(text, str) or not text.strip():
            raise UsageError("the message is empty; type some text")
        messages = [*self.messages, {"role": "user", "content": text}]
        full = self.encode(messages)
        limit = self.session.spec.max_seq_len
        if len(full) >= limit:
            raise CacheOverflowError(
                f"the conversation would be {len(full)} tokens with this message; max_seq_len is {limit}. "
                "Start over with /reset (or reset()), or export with a larger --max-seq-len"
            )
        keep = common_prefix(self.tokens, full)
        keep = min(keep, len(full) - 1)  # prefill at least one token: its logits start the answer
        rewound, reprefilled = len(self.tokens) - keep, False
        try:
            self.session.rewind(rewound)
        except UsageError:  # e.g. a ring past its window: start over from the whole conversation
            self.session.reset()
            keep, reprefilled = 0, True
        self.tokens = self.tokens[:keep]
        self._turn_starts.append(keep)
        self.messages = messages
        new = full[keep:]
        gen = stream(self.session, new, max_new_tokens=min(max_new_tokens, limit - len(full)), sampling=sampling,
                     eos_ids=self.eos_ids, decode_text=self._decode, speculate=speculate,
                     draft_context=full[:keep], grammar=grammar)
        stats = dict(conversation_tokens=len(full), reused=keep, prefilled=len(new), rewound=rewound,
                     reprefilled=reprefilled)
        return Turn(self, gen, full, stats)

    def _record(self, prompt: list[int], generated: list[int], text: str) -> None:
        fed = self.session.position - len(prompt)  # generated tokens decoded into the cache (the last is not)
        if fed < 0:  # interrupted before the prefill ran
            self.session.rewind(self.session.position - len(self.tokens))
            self.messages.pop()
            self._turn_starts.pop()
            return
        self.tokens = [*prompt, *generated[:fed]]
        self.messages.append({"role": "assistant", "content": text})

    def undo(self) -> None:
        """Forget the last turn (its user message and answer); the cache goes back to before it."""
        if not self._turn_starts:
            raise UsageError("nothing to undo: the conversation has no turns")
        start = self._turn_starts.pop()
        del self.messages[-2:]
        try:
            self.session.rewind(len(self.tokens) - start)
            self.tokens = self.tokens[:start]
        except UsageError:  # a ring that cannot rewind so far: the next turn prefills everything
            self.session.reset()
            self.tokens = []

    def reset(self) -> None:
        """Start over: no turns, an empty cache (the system message, if any, stays)."""
        self.session.reset()
        self.messages, self.tokens, self._turn_starts = list(self._system), [], []

    @property
    def turns(self) -> int:
        return len(self._turn_starts)

    # --- save / load ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the conversation and its cache state to one ``.safetensors`` file (tensors + JSON metadata)."""
        from safetensors.torch import save_file

        snap = self.session.snapshot()
        names = [b.name for b in self.session.spec.buffers()]
        meta = {"format": SAVE_FORMAT, "version": str(SAVE_VERSION), "identity": snap.identity,
                "position": str(snap.position), "filled": json.dumps(sorted(snap.filled)),
                "messages": json.dumps(self.messages), "tokens": json.dumps(self.tokens),
                "turn_starts": json.dumps(self._turn_starts), "system": json.dumps(self._system)}
        path = Path(path)
        save_file({n: t.contiguous() for n, t in zip(names, snap.state, strict=True)}, str(path), metadata=meta)
        return path

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a conversation written by ``save`` from a session of the same artifact (checked)."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # not a safetensors file, truncated, missing
            raise UsageError(f"{path} is not a saved conversation ({type(e).__name__}: {e}); "
                             "write one with /save FILE") from e
        if meta.get("format") != SAVE_FORMAT or meta.get("version") != str(SAVE_VERSION):
            raise UsageError(f"{path} is not a kvtrace conversation (version {SAVE_VERSION}); write one with /save FILE")
        names = [b.name for b in self.session.spec.buffers()]
        if sorted(tensors) != sorted(names):
            raise UsageError(f"{path} holds cache tensors {sorted(tensors)[:4]}...; this session holds "
                             f"{names[:4]}...: it was saved from another model")
        try:
            tokens, messages = json.loads(meta["tokens"]), json.loads(meta["messages"])
            starts, system = json.loads(meta["turn_starts"]), json.loads(meta["system"])
            snap = Snapshot(int(meta["position"]), tuple(tensors[n] for n in names),
                            frozenset(json.loads(meta["filled"])), meta["identity"])
        except (KeyError, ValueError) as e:
            raise UsageError(f"{path} is a damaged conversation file ({e}); write it again with /save FILE") from e
        if len(tokens) != snap.position:
            raise UsageError(f"{path} is inconsistent: {len(tokens)} tokens for cache position {snap.position}")
        self.session.restore(snap)  # checks identity, shapes and dtypes; the session is untouched if refused
        self.tokens, self.messages, self._turn_starts, self._system = tokens, messages, starts, system

