"""Chat templates: HF-style jinja2 templates compiled and rendered without transformers.

``apply_chat_template`` renders messages as transformers does (sandboxed, trim/lstrip blocks, loop
controls, ``tojson``, ``raise_exception``, ``strftime_now``, ``{% generation %}``); ``encode_prompt``
turns one user prompt into token ids, through the template or as plain text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from kvtrace._errors import SourceError

__all__ = ["apply_chat_template", "encode_prompt"]


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):  # `{% generation %}...{% endgeneration %}` (HF assistant masks): a no-op
        tags = {"generation"}  # noqa: RUF012

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    # Same environment as transformers' apply_chat_template: sandboxed, trim/lstrip blocks, loop controls.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
    return env.from_string(template)


def apply_chat_template(
    template: str | None,
    messages: list[dict],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with a HF-style jinja2 chat template."""
    if template is None:
        raise SourceError(
            "expected a chat template, but this model has none; pass the prompt as plain text with --raw"
        )
    import jinja2

    try:
        return _compile(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as e:
        raise SourceError(
            f"the chat template rejected the messages ({e}); fix the messages or use --raw"
        ) from e



def encode_prompt(tokenizer: Any, text: str, *, chat: bool, template: str | None, bos_id: int | None,
                  eos_ids: Sequence[int], require_template: bool = True) -> list[int]:
    """Token ids of one user prompt (``tokenizer``: a ``tokenizers.Tokenizer``).

    ``chat``: ``text`` is rendered by ``template`` as one user message with a generation prompt, BOS/EOS
    named by their ids, and encoded without the tokenizer's special tokens (the template places them);
    a missing template is a SourceError unless ``require_template=False``, which encodes the text as it
    is. Without ``chat``: the plain text with the tokenizer's special tokens.
    """
    if chat and (template or require_template):
        name = lambda i: tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
        text = apply_chat_template(template, [{"role": "user", "content": text}],
                                   bos_token=name(bos_id), eos_token=name(eos_ids[0] if eos_ids else None))
    return tokenizer.encode(text, add_special_tokens=not chat).ids
