"""argparse pieces shared by the commands: one-line errors (exit 2) and checked value types."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, NoReturn

from kvtrace._errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse with kvtrace's one-line errors (exit 2): ``kvtrace run: error: ... (see kvtrace run --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""
    want = f"a whole number >= {low}" if high is None else f"a whole number in [{low}, {high}]"

    def whole_number(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"expected {want}, got {v}")
        return v

    return whole_number


def number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def temperature(text: str) -> float:
    v = number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (0 = greedy), got {text!r}")
    return v


def probability(text: str) -> float:
    v = number(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return v


def int_list(text: str) -> str:
    """A comma list of whole numbers >= 1 (bench --prompt-len), kept as text."""
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() and int(t) >= 1 for t in items):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1 separated by commas, got {text!r}")
    return ",".join(items)


POSITIVE, SEED = int_in(1), int_in(0, 2**63 - 1)


KV_DTYPE_HELP = ("KV cache storage: auto (default) = the model's dtype; int8 = int8 K/V with a float16 scale per token "
                 "and KV head (~0.28x the bytes of a float32 cache)")


def kv_dtype_arg(p: argparse.ArgumentParser, many: bool = False) -> None:
    """``--kv-dtype {auto,int8}`` (or with ``many`` a comma list, one bench row each): the KV cache's storage
    (auto: the model's dtype; the others: what a CacheSpec can declare, ``spec.cache.KV_DTYPES``)."""
    from kvtrace.spec.cache import KV_DTYPES as QUANTIZED

    choices = ("auto", *QUANTIZED)
    if many:
        p.add_argument("--kv-dtype", type=choice_list(choices), default="auto", metavar="LIST",
                       help=f"comma list of {', '.join(choices)}: one row per choice (artifact backends). "
                            + KV_DTYPE_HELP)
    else:
        p.add_argument("--kv-dtype", choices=choices, default="auto", help=KV_DTYPE_HELP)


QUANT_HELP = ("weights: none (default) = the model's dtype; int8 = int8 per output channel; int4 = 4-bit groups "
              "with scale and zero; 8da4w = int4 weights, int8 dynamic activations (these three run torch's CPU "
              "kernels with bf16 activations; --backend executorch takes 8da4w, as XNNPACK's dynamically quantized "
              "GEMMs); gguf = a GGUF's own Q4_0/Q4_1/Q8_0 blocks kept as stored, computed in float32 (Llama-family "
              "decoders)")


QUANT_AUTO_HELP = ("auto (default) = gguf for a Llama / Qwen2 / Qwen3 / Phi-3 GGUF source stored mostly (>= half "
                   "its matrix weights) as Q4_0 / Q4_1 / Q8_0 blocks, in float32 on the CPU with a backend that takes them (aoti, exported): the "
                   "same numbers as its float32 weights, a fraction of the bytes a token reads; none otherwise")


def quant_args(p: argparse.ArgumentParser, many: bool = False, auto: bool = False) -> None:
    """``--quant`` (one scheme, or with ``many`` a comma list like bench's --dtype; with ``auto`` the default is
    "auto", resolved by ``chosen_quant``), ``--quant-group-size``, ``--no-quant-head``."""
    from kvtrace.spec.quant import GROUP_SIZES, SCHEMES

    choices = ("none", *SCHEMES)
    if many:
        p.add_argument("--quant", type=choice_list(choices), default="none", metavar="LIST",
                       help=f"comma list of {', '.join(choices)}: one row per choice. " + QUANT_HELP)
    elif auto:
        p.add_argument("--quant", choices=("auto", *choices), default="auto",
                       help=QUANT_AUTO_HELP + ". " + QUANT_HELP.replace("none (default)", "none"))
    else:
        p.add_argument("--quant", choices=choices, default="none", help=QUANT_HELP)
    p.add_argument("--quant-group-size", type=int, choices=GROUP_SIZES, default=None, metavar="G",
                   help=f"int4 / 8da4w: input features per scale, one of {list(GROUP_SIZES)} (default 32)")
    p.add_argument("--no-quant-head", dest="quant_head", action="store_false", default=True,
                   help="int8 / int4 / 8da4w: keep the embedding and output head in the model's dtype "
                        "(default: int8, one scale per row)")


def choice_list(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A comma list of ``choices`` (at least one, no repeats), kept as text."""
    def parse(text: str) -> str:
        items = [t.strip() for t in text.split(",")]
        bad = [t for t in items if t not in choices]
        if bad or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)} without repeats, "
                                             f"got {text!r}")
        return ",".join(items)

    return parse


QUANT_BACKEND = "aoti-packed"  # the default backend for int8 / int4 / 8da4w weights
QUANT_BACKEND_FOR = ("int8", "int4", "8da4w")


def backend_arg(p: argparse.ArgumentParser) -> None:
    """``--backend`` for commands that build a model source's artifact themselves (generate, chat): by default
    ``aoti``, and ``aoti-packed`` for quantized weights (``chosen_backend``)."""
    from kvtrace.backends import registry

    p.add_argument("--backend", choices=sorted(registry.names()), default=None,
                   help=f"default aoti; {QUANT_BACKEND} with --quant {'/'.join(QUANT_BACKEND_FOR)} (frozen programs "
                        "over Inductor's quantized GEMM templates: on SmolLM2 prefill 3-4x and decode 1.2-1.7x aoti's; "
                        "it compiles longer, in the background on a first run)")


GGUF_AUTO_SHARE = 0.5  # --quant auto keeps a GGUF's blocks when at least this share of its matrix weights are kept
# the GGUF architectures whose GGUF-native programs are verified end to end (tests/models/test_quant.py): every one
# kvtrace reads but "mistral" (the gguf package cannot read its tensors; llama.cpp labels Mistral models "llama")
GGUF_AUTO_ARCHS = ("llama", "qwen2", "qwen3", "phi3")


def chosen_quant(args: argparse.Namespace) -> str:
    """``--quant`` as given, with "auto" resolved: "gguf" where the source is a GGUF of ``GGUF_AUTO_ARCHS`` stored
    mostly as blocks kvtrace keeps and the run can keep them (float32, CPU, the model's KV dtype, a backend that keeps GGUF blocks in
    its programs: one that offers the scheme and does not fold weights into one program, as ``export`` checks),
    else "none". GGUF-native programs compute with exactly the GGUF's dequantized values, which is what the float32
    path loads too: the choice changes the bytes read per token, not the numbers."""
    from kvtrace.backends import registry

    quant = getattr(args, "quant", "auto")
    if quant != "auto":
        return str(quant)
    backend = registry.get(getattr(args, "backend", None) or "aoti")
    if (backend.quant_activations("gguf") is None or backend.packs_weights
            or getattr(args, "dtype", "float32") != "float32" or str(getattr(args, "device", "cpu")) != "cpu"
            or getattr(args, "kv_dtype", "auto") not in (None, "auto") or str(args.model).endswith((".kvt", ".pte"))):
        return "none"  # combinations GGUF-native programs are not tested in (an int8 KV cache among them)
    from kvtrace.sources.gguf import check_gguf
    from kvtrace.sources.gguf_blocks import kept_share
    from kvtrace.sources.resolve import resolve_source

    src = resolve_source(args.model)
    if src.kind not in ("default", "gguf") or check_gguf(src.path).arch not in GGUF_AUTO_ARCHS:
        return "none"
    return "gguf" if kept_share(src.path) >= GGUF_AUTO_SHARE else "none"


def chosen_backend(args: argparse.Namespace) -> str:
    """``--backend`` if given, else the default for ``--quant``."""
    if args.backend is not None:
        return str(args.backend)
    return QUANT_BACKEND if getattr(args, "quant", None) in QUANT_BACKEND_FOR else "aoti"


def tiered_arg(p: argparse.ArgumentParser) -> None:
    """``--no-tiered``: on an artifact-cache miss, wait for the compile instead of starting on the eager decoder."""
    p.add_argument("--no-tiered", dest="tiered", action="store_false", default=True,
                   help="on a cache miss, compile first and answer after (default: answer at once with the eager "
                        "decoder while the compile runs in a background process, then switch to the compiled "
                        "programs between two tokens, the cache kept)")


def penalty(text: str) -> float:
    v = number(text)
    if not -2 <= v <= 2:
        raise argparse.ArgumentTypeError(f"expected a number in [-2, 2] (0 = off), got {text!r}")
    return v


def positive_number(text: str) -> float:
    v = number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def logit_bias(text: str) -> tuple[int, float]:
    """``ID:BIAS`` -> (token id, bias in [-100, 100])."""
    tok, sep, b = text.partition(":")
    try:
        pair = (int(tok), float(b)) if sep else None
    except ValueError:
        pair = None
    if pair is None or pair[0] < 0 or not -100 <= pair[1] <= 100:
        raise argparse.ArgumentTypeError(f"expected ID:BIAS (a token id >= 0 and a bias in [-100, 100], e.g. "
                                         f"2:-100 to ban token 2), got {text!r}")
    return pair


def sampling_knobs(p: argparse.ArgumentParser) -> None:
    """Sampling's options (``sampling_of`` reads them back)."""
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=POSITIVE, default=None)
    p.add_argument("--top-p", type=probability, default=None, help="in (0, 1]")
    p.add_argument("--seed", type=SEED, default=None)
    p.add_argument("--repetition-penalty", type=positive_number, default=1.0, metavar="R",
                   help="divide the logit of a token already in the prompt or the answer by R (multiply, if "
                        "negative) before sampling, greedy too (1 = off, the default; 1.1-1.3 curbs loops)")
    p.add_argument("--presence-penalty", type=penalty, default=0.0, metavar="P",
                   help="subtract P from the logit of a token already in the answer (OpenAI's; [-2, 2], default 0)")
    p.add_argument("--frequency-penalty", type=penalty, default=0.0, metavar="F",
                   help="subtract F times the number of times a token is already in the answer (OpenAI's; [-2, 2], "
                        "default 0)")
    p.add_argument("--logit-bias", type=logit_bias, action="append", default=[], metavar="ID:BIAS",
                   help="add BIAS (in [-100, 100]; -100 bans the token) to token ID's logit before sampling "
                        "(OpenAI's logit_bias); repeat for more tokens")


def sampling_of(args: argparse.Namespace) -> Any:
    """The ``Sampling`` that ``sampling_knobs``' options ask for."""
    from kvtrace.runtime.generate import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p, args.seed, repetition_penalty=args.repetition_penalty,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    logit_bias=tuple(getattr(args, "logit_bias", [])))


def speculate_arg(p: argparse.ArgumentParser, builds: bool) -> None:
    """``--speculate K``: prompt-lookup speculative decoding (``runtime.speculate``), 0 = off."""
    from kvtrace.runtime.speculate import MAX_DRAFT

    where = ("its artifact is exported with every position's prefill logits (--prefill-logits all), a cache entry "
             "of its own" if builds else "the artifact must be exported with --prefill-logits all")
    p.add_argument("--speculate", type=int_in(0, MAX_DRAFT), default=0, metavar="K",
                   help="speculative decoding without a draft model: each step verifies up to K tokens copied from "
                        "where the text's last few tokens occurred before (prompt lookup), in one program call, and "
                        "keeps those the model's own samples agree with (same sampling; greedy answers the same "
                        f"up to near-ties); fast where the answer repeats its context (rewrites, edits, code). {where}. "
                        "Default 0: off")


def constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output (``runtime.grammar``): at most one of --json-schema / --json-object / --regex / --grammar /
    --choice."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="answer with JSON valid under this JSON schema: a file (.json) or the schema itself; every "
                        "token is sampled from those that keep the answer valid, and it ends when the JSON is "
                        "complete (needs llguidance: pip install 'kvtrace[grammar]')")
    g.add_argument("--json-object", action="store_true", help="answer with a JSON object (any)")
    g.add_argument("--regex", default=None, metavar="PATTERN", help="answer with text the whole of which matches PATTERN")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="answer with text derived from this grammar: a Lark grammar (llguidance's variant, rule "
                        "`start`), or llama.cpp's GBNF for a .gbnf file (rule `root`)")
    g.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="answer with exactly one of these texts (repeat: --choice yes --choice no)")


def constraint_of(args: argparse.Namespace) -> Any:
    """The ``Constraint`` constraint_args' options ask for (checked by llguidance), or None."""
    from pathlib import Path

    from kvtrace.runtime.grammar import Constraint

    if getattr(args, "json_schema", None) is not None:
        text = args.json_schema
        if not text.lstrip().startswith(("{", "true", "false")):  # a file
            path = Path(text)
            if not path.is_file():
                raise UsageError(f"--json-schema {text!r}: no such file, and not a JSON schema object either "
                                 "(give a .json file or the schema itself, e.g. '{\"type\": \"object\"}')")
            text = path.read_text(encoding="utf-8", errors="replace")
        return Constraint.json_schema(text).check()
    if getattr(args, "json_object", False):
        return Constraint.json_object().check()
    if getattr(args, "regex", None) is not None:
        return Constraint.regex(args.regex).check()
    if getattr(args, "grammar", None) is not None:
        path = Path(args.grammar)
        if not path.is_file():
            raise UsageError(f"--grammar {args.grammar!r}: no such file (give a Lark grammar file, or a .gbnf one)")
        text = path.read_text(encoding="utf-8", errors="replace")
        return (Constraint.gbnf(text) if path.suffix.lower() == ".gbnf" else Constraint.lark(text)).check()
    if getattr(args, "choice", None):
        return Constraint.choice(args.choice).check()
    return None


def sampling_args(p: argparse.ArgumentParser) -> None:
    sampling_knobs(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--chat", dest="chat", action="store_true", default=True, help="apply the chat template (default)")
    g.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as plain text")


def common(p: argparse.ArgumentParser, json_flag: bool) -> None:
    if json_flag:
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    else:
        p.add_argument("--json", default=None, metavar="OUT", help="write every step's numbers as JSON to OUT")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress or stats on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")



def device_type(text: str) -> str:
    """An argparse type: cpu, cuda or cuda:N (checked against this machine where it is used)."""
    import re

    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def device_arg(p: argparse.ArgumentParser, default: str | None = "cpu", what: str = "") -> None:
    """``--device {cpu,cuda,cuda:N}``: where programs are compiled for and run."""
    p.add_argument("--device", type=device_type, default=default, metavar="{cpu,cuda,cuda:N}",
                   help=what or "where the programs are compiled for and run (default cpu)")


def huge_pages_arg(p: argparse.ArgumentParser) -> None:
    """``--huge-pages``: the artifact's weights in transparent huge pages (``kvtrace.load(..., huge_pages=True)``)."""
    p.add_argument("--huge-pages", action="store_true",
                   help="hold the weights in transparent huge pages (Linux): float32 decode ~5-10%% faster on the "
                        "VMs measured, load slower (~0.5-1 s more for 500 MB); off by default")


def cuda_graphs_arg(p: argparse.ArgumentParser) -> None:
    """``--cuda-graphs``: decode replays CUDA graphs (CUDA artifacts only)."""
    p.add_argument("--cuda-graphs", action="store_true",
                   help="decode by replaying CUDA graphs, one per key_pos bucket (CUDA artifacts; off by default)")
