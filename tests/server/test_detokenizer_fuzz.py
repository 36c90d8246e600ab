"""Hypothesis on the tokenizer/detokenizer edges: NUL, combining marks, emoji, lone surrogates,
and token sequences whose bytes are not valid UTF-8 at token boundaries. Reference: the HF
tokenizer's full decode of the same ids (what a non-streaming answer shows)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.server.detokenizer import IncrementalDetokenizer
from tandem.server.errors import APIError
from tandem.server.tokenizer import Tokenizer

SETTINGS = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
EDGE_CHARS = st.sampled_from(["\x00", "\u0301", "\u0308", "e\u0301", "\U0001F600", "\U0001F469\u200d\U0001F4BB",
                              "\ufffd", "\u00e9", "\u4e2d", " ", "\n", "a", "ab", "\u202e", "\ufeff"])
TEXT = st.lists(st.one_of(EDGE_CHARS, st.text(max_size=4)), max_size=12).map("".join)


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


def _stream(tok: Tokenizer, prompt: list[int], out: list[int], stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, stop)
    chunks = []
    for token_id in out:
        done = detok.add_token(token_id)
        chunks.append(detok.take_text(done))
        if done:
            return chunks, detok
    detok.finish()
    chunks.append(detok.take_text(True))
    return chunks, detok


@SETTINGS
@given(text=TEXT)
def test_encode_decode_round_trips_edge_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


@SETTINGS
@given(text=TEXT, at=st.integers(0, 12), half=st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]))
def test_lone_surrogate_is_a_400_not_a_crash(tok, text, at, half):
    bad = text[:at] + half + text[at:]
    with pytest.raises(APIError) as err:
        tok.encode(bad)
    assert err.value.status == 400 and err.value.param == "prompt"


@SETTINGS
@given(data=st.data())
def test_streamed_text_equals_full_decode(tok, data):
    """Random ids (byte-level tokens: many are partial UTF-8) streamed one by one: the chunks join
    to the full decode, none holds a surrogate, and none but the last ends in an incomplete char."""
    vocab = len(tok.hf)
    out = data.draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=24))
    chunks, _ = _stream(tok, [], out, [])
    assert "".join(chunks) == tok.decode(out)
    for chunk in chunks:
        chunk.encode("utf-8")  # never a lone surrogate
    for chunk in chunks[:-1]:
        assert not chunk.endswith("\ufffd") or "\ufffd" in tok.decode(out)


@SETTINGS
@given(data=st.data(), prompt_text=TEXT)
def test_streamed_text_after_a_prompt(tok, data, prompt_text):
    prompt = tok.encode(prompt_text or "x", add_special_tokens=False)
    out = data.draw(st.lists(st.integers(3, len(tok.hf) - 1), min_size=1, max_size=16))
    chunks, _ = _stream(tok, prompt, out, [])
    full, head = tok.decode(prompt + out), tok.decode(prompt)
    if not head.endswith("\ufffd") and full.startswith(head):
        assert "".join(chunks) == full[len(head):]


@SETTINGS
@given(data=st.data(), stop=st.lists(st.one_of(EDGE_CHARS, st.text(min_size=1, max_size=3)), min_size=1, max_size=3))
def test_stop_strings_never_leak(tok, data, stop):
    """The streamed text never contains a stop string, nothing sent is taken back, and it is a
    prefix of the full decode (cut at the first stop string)."""
    out = data.draw(st.lists(st.integers(3, len(tok.hf) - 1), min_size=1, max_size=24))
    chunks, detok = _stream(tok, [], out, stop)
    text = "".join(chunks)
    assert text == detok.text
    assert not any(s in text for s in stop)
    full = tok.decode(out)
    if detok.stop_reason is None:
        assert text == full
    else:
        assert full.startswith(text) and full[len(text):].startswith(detok.stop_reason) or "\ufffd" in full
