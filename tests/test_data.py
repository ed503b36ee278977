"""The tokenizer, the corpus, batches and shards: the ground every equivalence test stands on."""
import numpy as np
import pytest

from minidist.data import Dataset, DataError, decode, default_corpus, encode, load_text, shard_slice


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓ 漢字", "tab\tnewline\n\0nul"])
def test_tokenizer_round_trip(text):
    ids = encode(text)
    assert ids.dtype == np.uint8 and ids.max(initial=0) < 256
    assert decode(ids) == text


def test_default_corpus_is_local_text():
    text = default_corpus()
    assert len(text) > 100_000, "the default corpus should be big enough to train on"
    assert "def " in text


def test_batches_are_a_pure_function_of_seed_and_step():
    d1 = Dataset.from_text(default_corpus()[:50_000], block_size=16, seed=3)
    d2 = Dataset.from_text(default_corpus()[:50_000], block_size=16, seed=3)
    x1, y1 = d1.get_batch("train", 4, step=7)
    x2, y2 = d2.get_batch("train", 4, step=7)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert np.array_equal(x1[:, 1:], y1[:, :-1]), "targets are inputs shifted by one token"
    x3, _ = d1.get_batch("train", 4, step=8)
    assert not np.array_equal(x1, x3)


def test_load_text_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_text(tmp_path / "empty.txt")
    (tmp_path / "bin.dat").write_bytes(b"\x89PNG\0\0\xff\xfe")
    with pytest.raises(DataError, match="not a text file"):
        load_text(tmp_path / "bin.dat")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_text(tmp_path / "latin1.txt")
    with pytest.raises(DataError, match="not a regular file"):
        load_text(tmp_path)
    with pytest.raises(DataError, match="too few"):
        Dataset.from_text("short text", block_size=64)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_cover_the_global_batch_once(world):
    batch = 24
    rows = np.concatenate([np.arange(batch)[shard_slice(batch, r, world)] for r in range(world)])
    assert np.array_equal(rows, np.arange(batch))


def test_shard_errors_say_what_to_choose():
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_slice(10, 0, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_slice(12, 0, 4, micro_batches=2)
