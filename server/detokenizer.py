"""Incremental detokenization with stop strings, one instance per engine request."""
from tandem.server.tokenizer import Tokenizer

# Prompt tokens kept as left context so the first output token decodes with the right spacing.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns output token ids into text as they arrive and watches for stop strings.

    Decodes a small window of tokens (`prefix_offset:`) and emits what it adds over the
    window's already-emitted part, holding back incomplete UTF-8 ("\\ufffd"). Stop strings
    are searched only around new text; the match and everything after it are cut. While
    streaming, the last max(len(stop)) - 1 characters are held back, so no prefix of a stop
    string is ever sent and later taken back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT - 1:])
        self.prefix_offset = max(len(self.token_ids) - _PROMPT_CONTEXT, 0)
        self.read_offset = len(self.token_ids)
        self.stop = stop or []
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stop_reason: str | None = None  # the stop string that matched
        self.emitted = 0  # characters of `text` already handed out by `take_text`

    def add_token(self, token_id: int) -> bool:
        """Append one token; True when a stop string completed (text is then cut before it)."""
        self.token_ids.append(token_id)
        window = self.token_ids[self.prefix_offset:]
        prefix_text = self.tokenizer.decode(window[:self.read_offset - self.prefix_offset], self.skip_special_tokens)
        new_text = self.tokenizer.decode(window, self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        start = len(self.text)
        self.text += delta
        return self._check_stop(start)

    def finish(self) -> None:
        """The request ended: emit what incomplete UTF-8 was held back (as full decode would)."""
        if self.stop_reason is None and self.read_offset < len(self.token_ids):
            window = self.token_ids[self.prefix_offset:]
            prefix_text = self.tokenizer.decode(window[:self.read_offset - self.prefix_offset], self.skip_special_tokens)
            new_text = self.tokenizer.decode(window, self.skip_special_tokens)
            self.read_offset = len(self.token_ids)
            start = len(self.text)
            self.text += new_text[len(prefix_text):]
            self._check_stop(start)

    def _check_stop(self, new_text_start: int) -> bool:
        best = None
        for stop in self.stop:
            idx = self.text.find(stop, max(0, new_text_start - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        self.text = self.text[:best[0]]
        self.stop_reason = best[1]
        return True

    def take_text(self, finished: bool) -> str:
        """The text not handed out yet, minus the stop-string holdback unless finished."""
        end = len(self.text) if finished or self.stop_reason else max(len(self.text) - self.holdback, self.emitted)
        chunk = self.text[self.emitted:end]
        self.emitted = end
        return chunk
