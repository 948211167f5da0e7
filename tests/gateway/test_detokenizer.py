"""Incremental detokenization and stop strings, on SmolLM2's byte-level tokenizer."""
import random

from actors.text.detokenizer import IncrementalDetokenizer, SampleText, StopMatcher

TEXT = "Hello 😀 世界! Ça va? 🇫🇷 naïve 東京タワー 👩‍👩‍👧 end"


def stream(detok, ids, split):
    deltas = []
    i = 0
    while i < len(ids):
        deltas.append(detok.push(ids[i:i + split]))
        i += split
    deltas.append(detok.flush())
    return deltas


def test_emoji_and_cjk_never_emitted_half_done(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT)
    # The tokenizer really splits characters across tokens, or the test proves nothing.
    assert any("\ufffd" in smol_tokenizer.decode([i]) for i in ids)
    for split in (1, 2, 3, 7):
        detok = IncrementalDetokenizer(smol_tokenizer)
        deltas = stream(detok, ids, split)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == TEXT == detok.text
        assert detok.output_token_ids == ids


def test_joined_deltas_equal_full_decode_on_random_tokens(smol_tokenizer):
    rng = random.Random(0)
    vocab = smol_tokenizer.vocab_size
    for trial in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        detok = IncrementalDetokenizer(smol_tokenizer, prompt)
        joined = "".join(stream(detok, ids, rng.randrange(1, 5)))
        assert joined == smol_tokenizer.decode(ids, skip_special_tokens=True), trial


def test_special_tokens_skipped(smol_tokenizer):
    ids = smol_tokenizer.encode("Hi there") + [smol_tokenizer.eos_token_ids[0]]
    detok = IncrementalDetokenizer(smol_tokenizer)
    assert "".join(stream(detok, ids, 1)) == "Hi there"


def test_stop_string_across_deltas():
    m = StopMatcher(["o W"])
    out = [m.push("Hel"), m.push("lo "), m.push("Wor"), m.push("ld")]
    assert out == ["Hel", "l", "", ""]
    assert m.stopped and m.matched == "o W"
    assert m.flush() == ""


def test_include_stop_keeps_the_stop_string_and_nothing_after_it():
    m = StopMatcher(["o W"], include_stop=True)
    out = [m.push("Hel"), m.push("lo "), m.push("Wor"), m.push("ld")]
    assert "".join(out) == "Hello W" and m.matched == "o W"


def test_stop_prefix_held_then_released():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == "abc "
    assert m.push("OX") == "STOX"
    assert m.push("S") == ""
    assert m.flush() == "S"
    assert not m.stopped


def test_first_completed_stop_wins():
    m = StopMatcher(["bcd", "abcdef"])
    assert m.push("xabcdefg") == "xa"
    assert m.matched == "bcd"
    m = StopMatcher(["\n\n", "world"])
    assert m.push("hello world\n\nmore") == "hello "


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.push("abc") == "abc"
    assert m.flush() == ""


def test_sample_text_stop_on_emoji_across_tokens(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT)
    sample = SampleText(smol_tokenizer, stop=["世界"])
    deltas = [sample.push([i]) for i in ids] + [sample.finish()]
    assert "".join(deltas) == sample.text == "Hello 😀 "
    assert sample.stopped
    assert sample.push(ids) == ""


def test_sample_text_without_stop_returns_all(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT)
    sample = SampleText(smol_tokenizer, stop=["never there", "end!"])
    deltas = [sample.push(ids[i:i + 2]) for i in range(0, len(ids), 2)] + [sample.finish()]
    assert "".join(deltas) == TEXT
    assert not sample.stopped
