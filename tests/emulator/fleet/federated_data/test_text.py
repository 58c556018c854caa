from __future__ import annotations

import numpy as np
import pytest

from emulator.fleet.federated_data import CharWindows, encode_characters, encode_words


@pytest.mark.parametrize(
    ("words", "dtype"), [(255, np.uint8), (256, np.uint16), (65_535, np.uint16), (65_536, np.int32)]
)
def test_word_ids_take_the_smallest_dtype_that_holds_the_vocabulary_and_its_unknown_id(words, dtype):
    """Ids were int64 whatever the vocabulary: 8 bytes for what 1 or 2 hold."""
    vocab = tuple(f"w{i}" for i in range(words))
    ids = encode_words([f"w0 w{words - 1} nope"], vocab, max_words=4)
    assert ids.dtype == dtype and ids.tolist() == [[0, words - 1, words, words]]  # unknown and padding: len(vocab)


def test_character_ids_and_windows_are_uint8_with_the_unknown_character_80():
    ids = encode_characters("ab~é\n")
    assert ids.dtype == np.uint8 and ids.tolist() == [53, 54, 80, 80, 0]
    cut = CharWindows("text", window=3).cut({"c": {"text": np.array(["abcde"], dtype=object)}})["c"]
    assert cut["x"].dtype == cut["y"].dtype == np.uint8 and cut["x"].tolist() == [[53, 54, 55], [54, 55, 56]]
    assert cut["y"].tolist() == [56, 57]
