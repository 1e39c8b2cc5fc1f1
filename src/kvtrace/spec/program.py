"""ProgramSpec: the declared signature of each program an artifact holds.

Every program has the same spine — ``(tokens [B, T], input_pos [T], *inputs, *cache) -> logits [B, T, V]``
(with ``key_pos [L]`` after ``input_pos`` when the program attends to the live cache prefix only)
— and differs only in its token count (``T`` symbolic in ``[1, max_seq_len]`` or fixed at 1), in the
extra inputs it takes between ``input_pos`` and the cache (e.g. the image features of a vision
decoder's prefill), and in whether it fills state that then stays until ``reset()``.

Invariants (checked in ``__post_init__``):
  * input names are unique and none is ``tokens`` or ``input_pos``;
  * an input's shape holds ints (fixed sizes) and the symbols ``"B"`` (the batch) and ``"T"``
    (the call's token count); dtypes name torch dtypes;
  * every decoder has a ``"prefill"`` and a ``"decode"`` program (``DEFAULT_PROGRAMS``), and the two
    agree on ``key_pos`` (a Session, and aoti-packed's single program, serve both with one signature);
  * ``logits`` is ``"all"`` (``[B, T, V]``) or ``"last"`` (``[B, 1, V]``: the head runs on the last
    position only, as HF ``generate`` computes it; a generation needs nothing else);
  * ``key_pos``: the program takes ``key_pos [L] int64 = 0 .. L-1`` after ``input_pos``, L = the
    position after the call (symbolic, 1..max_seq_len), and its self-attention reads cache slots
    ``[0, L)`` only — the live prefix — instead of all max_seq_len slots. The caller (a Session) builds
    it from its position; nothing in the program reads a length from a tensor's values.
  * ``slots``: the cache's B rows are independent conversation slots (``kvtrace serve``). The program
    advances R of them (R symbolic, 1..B), named by ``slots [R] int64`` after ``key_pos``, each at its own
    positions: ``tokens [R, T]``, ``input_pos [R, T]``, logits ``[R, T or 1, V]``. Its self-attention
    reads, per row, the slots of ``key_pos`` (L = the longest row's position after the call), masked by
    that row's own positions. A prefill with R = 1 fills one slot; a one-token program with R rows
    decodes every active slot in one step. Needs ``key_pos``; takes no declared inputs.
  * ``served_by``: the name of another program whose compiled code serves this one (None: its own). Set by
    a backend (``aoti``), never by a decoder: a one-token program served by a T-symbolic program that
    agrees with it on everything else (method, inputs, key_pos, slots), called with T = 1. Not its own
    name; the serving program is served by no other (checked against the whole set at load,
    ``backends.aoti``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import ArtifactError, UsageError

__all__ = ["DEFAULT_PROGRAMS", "InputSpec", "ProgramSpec", "program_specs", "read_inputs_file"]

SYMBOLS = ("B", "T")
SPINE = ("tokens", "input_pos", "key_pos", "slots")  # names a declared input cannot take
LOGITS = ("all", "last")


@dataclass(frozen=True)
class InputSpec:
    """One non-cache input of a program, e.g. ``cross_attention_states [B, 6, 64] float32``."""

    name: str
    shape: tuple[int | str, ...]  # ints are fixed; "B" = batch, "T" = the call's token count
    dtype: str  # torch dtype name without "torch."
    doc: str = ""  # one line for error messages and `kvtrace run --help`
    default: float | None = None  # None: required; else omitted means a tensor filled with this value
    binary: bool = False  # a 0/1 mask: any dtype accepted (bool, int, float), cast to ``dtype``

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name in SPINE:
            raise UsageError(f"program input name must be an identifier other than {'/'.join(SPINE)}, got {self.name!r}")
        for d in self.shape:
            if not (d in SYMBOLS or (isinstance(d, int) and not isinstance(d, bool) and d >= 1)):
                raise UsageError(f"input {self.name}: shape entries are ints >= 1 or one of {SYMBOLS}, got {d!r}")
        if not isinstance(getattr(torch, str(self.dtype), None), torch.dtype):
            raise UsageError(f"input {self.name}: dtype must name a torch dtype, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def concrete(self, batch: int, t: int) -> tuple[int, ...]:
        return tuple(batch if d == "B" else t if d == "T" else int(d) for d in self.shape)

    def describe(self) -> str:
        return f"{self.name}[{', '.join(map(str, self.shape))}] {self.dtype}"


@dataclass(frozen=True)
class ProgramSpec:
    """A program: ``method`` of the Decoder, captured with ``T`` symbolic (or 1 when ``single_token``)."""

    name: str
    method: str = "forward"
    single_token: bool = False
    inputs: tuple[InputSpec, ...] = field(default_factory=tuple)
    # Fills state that stays until reset() (e.g. cross-attention K/V of an image): at most once per session.
    once: bool = False
    logits: str = "all"  # "all": logits [B, T, V]; "last": [B, 1, V], the last position's only
    key_pos: bool = False  # takes key_pos [L] after input_pos: attention reads cache slots [0, L) only
    slots: bool = False  # advances the cache rows slots [R] (after key_pos), each at its own input_pos [R, T]
    served_by: str | None = None  # another program's compiled code runs this one (T = 1); None: its own

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if self.logits not in LOGITS:
            raise UsageError(f"program {self.name}: logits must be one of {LOGITS}, got {self.logits!r}")
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise UsageError(f"program {self.name}: input names must be unique, got {names}")
        if self.slots and (not self.key_pos or self.inputs or self.once):
            raise UsageError(f"program {self.name}: a slots program takes key_pos and no declared inputs and is not "
                             f"`once`; got key_pos={self.key_pos}, inputs {names}, once={self.once}")
        if self.served_by is not None and (not isinstance(self.served_by, str) or self.served_by == self.name
                                           or not self.single_token):
            raise UsageError(f"program {self.name}: served_by names another program serving this one-token "
                             f"program; got served_by={self.served_by!r}, single_token={self.single_token}")

    def spine(self, batch: int | str = "B", t: int | str = "T", rows: int | str = "R",
              keys: int | str = "L") -> list[tuple[str, tuple[int | str, ...], str]]:
        """(name, shape, dtype) of the inputs before the declared ones, in call order: tokens, input_pos,
        then key_pos and slots when the program takes them. Sizes are the given ints, or symbols; ``t`` is
        replaced by 1 for a one-token program, ``batch`` by ``rows`` for a slots program."""
        t = 1 if self.single_token else t
        if self.slots:
            out = [("tokens", (rows, t), "int64"), ("input_pos", (rows, t), "int64")]
        else:
            out = [("tokens", (batch, t), "int64"), ("input_pos", (t,), "int64")]
        if self.key_pos:
            out.append(("key_pos", (keys,), "int64"))
        if self.slots:
            out.append(("slots", (rows,), "int64"))
        return out

    def signature(self) -> str:
        spine = ", ".join(f"{n}[{','.join(map(str, shape))}] {dtype}" for n, shape, dtype in self.spine())
        extra = "".join(f", {i.describe()}" for i in self.inputs)
        rows = "R" if self.slots else "B"
        out = "1" if self.logits == "last" or self.single_token else "T"
        return f"({spine}{extra}, *cache) -> logits[{rows},{out},V]"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.slots:
            del d["slots"]  # a plain program's manifest entry reads as before slot programs existed
        if self.served_by is None:
            del d["served_by"]  # likewise: a program compiled on its own
        d["inputs"] = [{**asdict(i), "shape": list(i.shape)} for i in self.inputs]
        d["signature"] = self.signature()
        return d

    @classmethod
    def from_dict(cls, name: str, d: Any) -> ProgramSpec:
        if isinstance(d, str):  # artifacts written before programs had specs: name -> signature text
            if name not in ("prefill", "decode"):
                raise ArtifactError(f"program {name!r} has no spec in the manifest; re-export the artifact")
            return ProgramSpec(name, single_token=name == "decode")
        if isinstance(d, dict):
            unknown = sorted(set(d) - {f.name for f in fields(cls)} - {"signature"})
            if unknown:
                from kvtrace import __version__

                raise ArtifactError(
                    f"program {name!r} in the manifest has field(s) {unknown} that kvtrace {__version__} does not "
                    "know: the artifact was written by a newer kvtrace. Upgrade kvtrace, or re-export with this one"
                )
        try:
            inputs = tuple(InputSpec(**{**i, "shape": tuple(i["shape"])}) for i in d.get("inputs", ()))
            rest = {k: v for k, v in d.items() if k not in ("inputs", "signature", "name")}
            return cls(name=name, inputs=inputs, **rest)
        except (KeyError, TypeError, UsageError) as e:
            raise ArtifactError(f"program {name!r} in the manifest is malformed ({e}); re-export the artifact") from e


DEFAULT_PROGRAMS = (ProgramSpec("prefill"), ProgramSpec("decode", single_token=True))


def program_specs(decoder: torch.nn.Module) -> tuple[ProgramSpec, ...]:
    """The programs a Decoder declares (``decoder.programs``), else prefill + decode of ``forward``."""
    specs = tuple(getattr(decoder, "programs", DEFAULT_PROGRAMS))
    names = [p.name for p in specs]
    if "prefill" not in names or "decode" not in names or len(set(names)) != len(names):
        raise UsageError(f"a Decoder declares unique programs including 'prefill' and 'decode'; got {names}")
    by = {p.name: p for p in specs}
    for flag in ("key_pos", "slots"):
        if getattr(by["prefill"], flag) != getattr(by["decode"], flag):
            raise UsageError(f"a Decoder's prefill and decode programs must agree on {flag}; got prefill "
                             f"{getattr(by['prefill'], flag)}, decode {getattr(by['decode'], flag)}")
    return specs


def read_inputs_file(path: str | os.PathLike[str], what: str = "--image-features") -> dict[str, torch.Tensor]:
    """Named program inputs from a ``.safetensors`` file (e.g. ``cross_attention_states``); no pickles."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise UsageError(f"{what} file {path} does not exist")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise UsageError(f"{what} {path} is not a readable .safetensors file ({e})") from e
    if not tensors:
        raise UsageError(f"{what} {path} holds no tensors; expected e.g. cross_attention_states [1, N, dim]")
    return tensors
