"""The HF tokenizer and what the API needs around it: prompts, chat templates, per-token strings."""
import logging
from functools import lru_cache
from pathlib import Path

from tandem.server.errors import APIError

logger = logging.getLogger(__name__)


class Tokenizer:
    """Wraps a Hugging Face tokenizer loaded from the engine's tokenizer folder."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path)
        self.path = path
        self.token_str = lru_cache(maxsize=1 << 16)(self._token_str)
        logger.info("tokenizer loaded: path=%s vocab=%d chat_template=%s", path, len(self.hf),
                    self.hf.chat_template is not None)

    def set_chat_template(self, template: str) -> None:
        """--chat-template: a file holding a Jinja template, or the template text itself."""
        path = Path(template)
        is_file = len(template) < 4096 and "{" not in template and path.is_file()
        if not is_file and "{" not in template:
            raise ValueError(f"--chat-template {template!r}: no such file, and not a Jinja template")
        self.hf.chat_template = path.read_text() if is_file else template
        logger.info("chat template set from %s", path if is_file else "the command line")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; text that is not valid Unicode (a lone surrogate) is the client's 400."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(f"the prompt is not valid Unicode: lone surrogate U+{ord(text[exc.start]):04X} at "
                           f"character {exc.start}", param="prompt") from None
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def _token_str(self, token_id: int) -> str:
        """The text of one token on its own, as shown in logprobs (special tokens kept)."""
        return self.hf.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """Render messages with the model's chat template and tokenize (the template adds BOS)."""
        if self.hf.chat_template is None:
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, **template_kwargs)
        except Exception as exc:  # jinja errors (raise_exception in templates) are the client's messages
            raise APIError(f"chat template failed on these messages: {exc}", param="messages") from exc
        return self.encode(text, add_special_tokens=False)
