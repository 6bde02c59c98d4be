"""Text in and out: prompts to token ids (completions verbatim, chat through the model's template) and
generated ids back to text, with OpenAI's stop-string semantics (the stop string is not part of the text).

Chat templates render in a worker process under time, output and memory limits (chat_template.py); call
``close`` when the prompts are done, to end it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.flood.batch.requests import Request
from lingctl.model.chat_template import RenderError, TemplateLimits, TemplateRenderer, check_syntax
from lingctl.model.checkpoint_files import TOKENIZER


class PromptError(ValueError):
    """A request that cannot be turned into token ids; reported for that request only."""


@dataclass(slots=True)
class TextCodec:
    tokenizer: Any | None  # tokenizers.Tokenizer
    chat_template: str | None
    # The tokenizer's named special tokens ({"eos_token": "<|endoftext|>", ...}), template variables.
    special_tokens: dict[str, str] = field(default_factory=dict)
    limits: TemplateLimits = field(default_factory=TemplateLimits)
    _renderer: TemplateRenderer | None = field(default=None, init=False, repr=False)

    @staticmethod
    def for_model(
        path: Path, *, chat_template: str | None, special_tokens: dict[str, str], limits: TemplateLimits | None = None
    ) -> TextCodec:
        tok = None
        if (path / TOKENIZER).exists():
            from lingctl.model.tokenizer import load_tokenizer

            tok = load_tokenizer(path / TOKENIZER)
        return TextCodec(tok, chat_template, dict(special_tokens), limits or TemplateLimits())

    def check_template(self) -> None:
        """``LingctlError`` when the template does not parse: that would fail every chat request."""
        if self.chat_template is not None:
            check_syntax(self.chat_template)

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def prompt_ids(self, req: Request) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if self.tokenizer is None:
            raise PromptError("the model has no tokenizer.json: send prompts as arrays of token ids")
        if req.is_chat:
            if self.chat_template is None:
                raise PromptError(
                    "the model has no chat template (tokenizer_config.json chat_template or "
                    "chat_template.jinja); pass --chat-template FILE or use /v1/completions"
                )
            if self._renderer is None:
                self._renderer = TemplateRenderer(self.chat_template, self.limits)
            try:
                text = self._renderer.render(
                    req.messages or [], add_generation_prompt=True, special_tokens=self.special_tokens
                )
            except RenderError as exc:
                raise PromptError(str(exc)) from None
            # The template already holds whatever special tokens the model expects.
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        # Completions: the prompt exactly as given, no BOS, no template (as OpenAI's completions endpoint).
        return self.tokenizer.encode(req.prompt_text or "", add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token as a log-probability entry names it: its own text (a piece of a character decodes to
        U+FFFD, as vLLM shows it), or ``token_id:N`` for a model without a tokenizer (vLLM's form)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def stop_check(self, generated: list[int], stops: list[str]) -> str | None:
        """Text before the earliest stop string, once one has appeared; else None."""
        text = self.decode(generated)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        return text[: min(hits)] if hits else None
