"""worker/token_text.py: the text of each token for logprobs, on real tokenizers."""

from __future__ import annotations

from pathlib import Path

from worker.token_text import TokenTexts

DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "genq-tiny-stdlib"


def texts_in_order(texts: TokenTexts, ids: list[int]) -> list[str]:
    return [texts.texts(ids[:pos], [ids[pos]])[ids[pos]] for pos in range(len(ids))]


def test_a_character_split_across_byte_tokens_is_carried_by_the_token_that_completes_it() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL))  # byte-level BPE
    text = "x = '日本' + 'é€😀'"
    ids = tokenizer.encode(text)
    got = texts_in_order(TokenTexts(tokenizer), ids)
    # The context window of '本' (4 tokens) starts inside '日': it is widened to start cleanly.
    assert got == ["<s>", "x", " =", " '", "", "", "日", "", "", "本", "'", " +", " '", "", "é",
                   "", "", "€", "", "", "", "😀", "'"]
    assert "".join(got) == "<s>" + text
    assert [tokenizer.decode([t]) for t in ids[4:7]] == ["\ufffd"] * 3  # alone: no text at all


def test_a_leading_space_a_tokenizer_drops_at_the_start_of_a_text_is_kept() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "▁sat": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")  # SentencePiece's
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert tokenizer.encode("the cat sat") == [1, 2, 3]
    assert tokenizer.decode([2]) == "cat"  # decoded alone, the space is gone
    texts = TokenTexts(tokenizer)
    assert texts.texts([1], [2, 3, 2]) == {2: " cat", 3: " sat"}
    assert texts_in_order(texts, [1, 2, 3]) == ["the", " cat", " sat"]
