"""The tokenizer fast paths give exactly the tokenizer's own ids and text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.tokenizer import (
    _BackendDecoder,
    _BackendEncoder,
    _TokenizerEncoder,
    fast_decoder,
    fast_encoder,
)

DEMO = Path(__file__).resolve().parents[2] / "models" / "genq-tiny-stdlib"
TEXTS = ["", " ", "the quick brown fox", "  two  spaces\tand\ttabs\n\nnewlines ",
         "<s>literal special</s> <pad>", "日本語 and 🙂 then Жψ", "def main():\n    return 0\n",
         "x" * 300, "ünïcödé café naïve", "\u200b zero width"]


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture
def with_bos(tiny_llama, tmp_path):
    """The test tokenizer with a post-processor that adds BOS, saved and loaded again."""
    from tokenizers.processors import TemplateProcessing

    tok = _tokenizer(tiny_llama)
    bos = tok.convert_tokens_to_ids("<s>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>",
                                                                                         bos)])
    tok.save_pretrained(str(tmp_path))
    return _tokenizer(tmp_path)


def test_fast_encoder_gives_the_tokenizers_ids(tiny_llama, with_bos):
    rng = random.Random(3)
    for tok in (_tokenizer(tiny_llama), _tokenizer(DEMO), with_bos):
        encode = fast_encoder(tok)
        assert isinstance(encode, _BackendEncoder)
        texts = TEXTS + ["".join(rng.choice("ab <>/sé🙂\n") for _ in range(rng.randrange(30)))
                         for _ in range(100)]
        for text in texts:
            assert encode(text) == list(tok(text).input_ids), text
    assert fast_encoder(with_bos)("hi")[0] == with_bos.convert_tokens_to_ids("<s>")


def test_a_tokenizer_subclass_keeps_its_own_encode(tiny_llama):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    class Shouting(TokenizersBackend):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.upper() if isinstance(text, str) else text,
                                        *args, **kwargs)

    tok = _tokenizer(tiny_llama)
    tok.__class__ = Shouting
    encode = fast_encoder(tok)
    assert isinstance(encode, _TokenizerEncoder)
    assert encode("the fox") == list(tok("the fox").input_ids) == \
        list(_tokenizer(tiny_llama)("THE FOX").input_ids)


def test_fast_decoder_gives_the_tokenizers_text(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    decoder = fast_decoder(tok)
    assert isinstance(decoder, _BackendDecoder)  # the test tokenizer does no space clean-up
    rng = random.Random(5)
    special = sorted(tok.all_special_ids)
    assert special
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == \
                tok.decode(ids, skip_special_tokens=skip)


def test_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert fast_decoder(tok) is tok




@pytest.mark.parametrize("model", ["tiny", "demo"])
def test_byte_table_decodes_exactly_as_the_backend(tiny_llama, model):
    from engine.tokenizer import byte_table

    tok = _tokenizer(tiny_llama if model == "tiny" else DEMO)
    decoder = fast_decoder(tok)
    table = byte_table(tok, decoder)
    assert table is not None
    added = set(tok._tokenizer.get_added_tokens_decoder())
    ordinary = [i for i in range(len(tok)) if i not in added]
    # Single-byte tokens above 0x7f: pieces of characters, alone or in the wrong order.
    partial = [i for i in ordinary if len(table.token_bytes[i]) == 1
               and table.token_bytes[i][0] >= 0x80]
    assert partial
    rng = random.Random(4)
    cases = [[rng.choice(ordinary) for _ in range(rng.randint(1, 12))] for _ in range(400)]
    cases += [[rng.choice(partial) for _ in range(rng.randint(1, 5))] for _ in range(200)]
    cases += [[t for t in tok(text).input_ids if t not in added] for text in TEXTS if text]
    for ids in cases:
        assert table.decode(ids) == decoder.decode(ids, skip_special_tokens=True), ids
    assert all(table.token_bytes[i] is None for i in added)
    assert table.join([ordinary[0], min(added)], 0) is None  # an added token: not ours to decode
    assert table.join([len(table.token_bytes) + 5], 0) is None


def test_no_byte_table_for_a_vocabulary_that_is_not_byte_level(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.tokenizer import byte_table

    vocab = {"<unk>": 0, "▁the": 1, "▁fox": 2, "the": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert byte_table(tok, fast_decoder(tok)) is None
    assert byte_table(tok, tok) is None  # not the backend's decoder either


def test_streamed_deltas_are_the_same_with_and_without_the_byte_table(tiny_llama):
    from engine.detokenizer import decode_delta, init_offsets
    from engine.sequence import Sequence
    from engine.tokenizer import byte_table

    tok = _tokenizer(tiny_llama)
    decoder = fast_decoder(tok)
    table = byte_table(tok, decoder)
    rng = random.Random(9)
    for text in TEXTS[1:] + ["".join(rng.choice("日本語🙂 aé→") for _ in range(40))]:
        ids = tok(text).input_ids
        runs = []
        for use in (None, table):
            prompt = tok("the fox").input_ids
            seq = Sequence(0, 0, list(prompt), len(prompt))
            init_offsets(seq)
            deltas = []
            for token in ids + [1, *ids[:3]]:  # "</s>" (an added token) in the middle
                seq.token_ids.append(token)
                deltas.append(decode_delta(decoder, seq, True, use))
            runs.append((deltas, seq.prefix_offset, seq.read_offset))
        assert runs[0] == runs[1], text
